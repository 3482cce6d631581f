"""What a device costs: the cost model, its measured and shipped profiles, calibration."""
