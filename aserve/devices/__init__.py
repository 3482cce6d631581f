"""The devices an instance steps on, behind one seam (device.py): torch (CPU or CUDA), simulated, Ray."""
