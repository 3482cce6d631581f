"""Scheduling: request bookkeeping, block manager and policies. Integers only: no torch, no asyncio."""
