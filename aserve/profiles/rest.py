"""Is the machine at rest? What ``aserve profile device`` checks before it saves a profile.

A profile timed while other processes share the cores is too slow for every later use: on
2026-11-28 a cached 1-thread profile of this CPU measured beside other jobs had a batch-1 decode
step of 185 ms, 81 ms at rest, and every SLO corner and ``sim:local`` estimate read from it was
2.3x loose without a word. Two signs, both kept in the profile's ``meta["rest"]``:

    others' CPU use   /proc/stat's busy time of the CPUs this process may run on (user, nice,
                      system, irq, softirq and steal: a hypervisor running someone else on our
                      vCPU) less this process's own (os.times), over 1 s before measuring and
                      over the whole measurement, in cores: at most REST_LIMIT_CORES
    probe step        the same decode step timed near the start and again at the end: within
                      PROBE_LIMIT of each other (a machine that slowed, or sped up, part way)

Torch-free: the measuring itself (aserve/profiles/device_profile.py) feeds it numbers.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

REST_LIMIT_CORES = 0.25  # other processes' average CPU use a profile may be measured beside
PROBE_LIMIT = 0.20  # how far the probe step's end time may stray from its start time
PRE_WINDOW_S = 1.0  # the look before measuring
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat cpu line: user nice system [idle iowait] irq softirq steal


@dataclass(frozen=True)
class CpuSample:
    """One look at the clock, every CPU's busy seconds so far, and this process's own CPU seconds."""

    wall_s: float
    busy_s: float
    own_s: float


def busy_seconds(stat_text: str, ticks_per_s: float, cpus: Optional[set[int]] = None,
                 fields=BUSY_FIELDS) -> float:
    """The busy seconds so far of ``cpus`` (None: every CPU, ``/proc/stat``'s aggregate ``cpu``
    line; a container sees its host's CPUs there, so ``sample`` passes the ones this process may
    run on). Guest time is already inside user time; idle and iowait are not busy. ``fields``:
    other columns of the line summed instead (steal alone: ``(7,)``)."""
    names = {"cpu"} if cpus is None else {f"cpu{i}" for i in cpus}
    total, found = 0, False
    for line in stat_text.splitlines():
        parts = line.split()
        if parts and parts[0] in names:
            values = [int(x) for x in parts[1:]]
            total += sum(values[i] for i in fields if i < len(values))
            found = True
    if not found:
        raise ValueError(f"no line for {'the aggregate cpu' if cpus is None else sorted(cpus)} in /proc/stat")
    return total / ticks_per_s


def sample(stat_path: str = "/proc/stat") -> Optional[CpuSample]:
    """Now, or None where the kernel does not say (no /proc/stat: not Linux)."""
    try:
        with open(stat_path) as f:
            text = f.read()
        busy = busy_seconds(text, os.sysconf("SC_CLK_TCK"), _our_cpus())
    except (OSError, ValueError):
        return None
    t = os.times()
    return CpuSample(time.monotonic(), busy, t.user + t.system)


def others_cores(first: Optional[CpuSample], last: Optional[CpuSample]) -> Optional[float]:
    """Cores other processes kept busy on average between two samples (None: unknown)."""
    if first is None or last is None or last.wall_s <= first.wall_s:
        return None
    others = (last.busy_s - first.busy_s) - (last.own_s - first.own_s)
    return max(0.0, others / (last.wall_s - first.wall_s))


def look(window_s: float = PRE_WINDOW_S) -> Optional[float]:
    """Other processes' CPU use over the next ``window_s`` seconds (this one sleeps through it)."""
    first = sample()
    time.sleep(window_s)
    return others_cores(first, sample())


def verdict(before: Optional[float], during: Optional[float], probe_first_s: Optional[float] = None,
            probe_last_s: Optional[float] = None, allowed_busy: bool = False) -> dict:
    """What was seen, as a profile's ``meta["rest"]``: others' cores before and during, the probe
    step's two times and their change, whether that is at rest, why not, and whether the profile
    was kept anyway (``--allow-busy``). Unknown figures (None) count as at rest: where the
    kernel does not say, the probe still does."""
    change = None
    if probe_first_s and probe_last_s:
        change = probe_last_s / probe_first_s - 1.0
    why = []
    for label, cores in (("before", before), ("during", during)):
        if cores is not None and cores > REST_LIMIT_CORES:
            why.append(f"other processes used {cores:.2f} cores {label} the measurement (at most "
                       f"{REST_LIMIT_CORES:g} at rest)")
    if change is not None and abs(change) > PROBE_LIMIT:
        why.append(f"the probe step ran {abs(change):.0%} {'slower' if change > 0 else 'faster'} at the end than at "
                   f"the start (at most {PROBE_LIMIT:.0%} at rest)")
    return {"at_rest": not why, "why": why, "others_cores_before": before, "others_cores_during": during,
            "limit_cores": REST_LIMIT_CORES, "probe_first_s": probe_first_s, "probe_last_s": probe_last_s,
            "probe_change": change, "probe_limit": PROBE_LIMIT, "allowed_busy": bool(allowed_busy and why)}


def describe(rest: dict) -> str:
    """One line: the figures a ``verdict`` holds."""
    parts = []
    for label in ("before", "during"):
        cores = rest.get(f"others_cores_{label}")
        if cores is not None:
            parts.append(f"others {cores:.2f} cores {label}")
    if rest.get("probe_change") is not None:
        parts.append(f"probe step {rest['probe_change']:+.1%} end to start")
    return ", ".join(parts) or "no figures (no /proc/stat, no probe)"


def _our_cpus() -> Optional[set[int]]:
    """The CPUs this process may run on (None where the platform does not say)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
