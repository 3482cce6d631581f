"""Which machine a profile was measured on, read without torch: its CPU by name and core count,
and the instruction-set flags that decide which kernels run (and so how fast a step is).

Two virtual machines can report the same CPU name with different flags (this project's AMD EPYC
VMs: one with AVX-512, one with AVX2 only); a profile keeps both, and one measured where either
differs says little of this machine.
"""
from __future__ import annotations

import functools
import os
import platform
from typing import Optional

# the flags that change which of our kernels (or torch's) run and how fast a matmul is
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> str:
    """/proc/cpuinfo, read once a process (a profile's every load compares the name and flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def machine() -> str:
    """The CPU (or GPU) a profile was measured on: a profile of one machine says little of another."""
    name = platform.processor() or platform.machine()
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
            break
    return f"{name}, {os.cpu_count()} cores"


def cpu_flags(cpuinfo: Optional[str] = None) -> list[str]:
    """The ``ISA_FLAGS`` this CPU has (from ``/proc/cpuinfo``'s first ``flags`` line), in that
    order; empty where there is no such file."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [f for f in ISA_FLAGS if f in have]
    return []
