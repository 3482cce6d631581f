"""What a soak samples, on the server's loop: the process's RSS and open sockets, each instance's
free blocks, the requests in flight and the server's connections every ``sample_period_s``; and the
event loop's lag, from a probe that sleeps ``lag_period_s`` and measures how late it wakes (every
value is kept for the percentiles; the series keeps each sample period's worst). The samples that
give RSS's two levels (the ``LEVEL_WINDOW_S`` after the warm-up, and those once the soak has
settled) trim the C heap first, so they compare memory in use, not what the allocator kept from
the last kill or re-add.
"""
from __future__ import annotations

import asyncio
import os
import resource
from pathlib import Path
from typing import Optional

from aserve.cluster.lifecycle import release_freed_memory
from aserve.event_loop import overslept
from aserve.soak.report import LEVEL_WINDOW_S
from aserve.soak.settings import SoakConfig

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size now (Linux), else the peak so far."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def open_sockets() -> Optional[int]:
    """Sockets this process holds open (Linux: its fds that are sockets); None where unknown."""
    fds = Path("/proc/self/fd")
    try:
        names = os.listdir(fds)
    except OSError:
        return None
    count = 0
    for name in names:
        try:
            count += os.readlink(fds / name).startswith("socket:")
        except OSError:  # closed since listed
            pass
    return count


class Probe:
    """``run()`` and ``lag_loop()`` until cancelled; ``samples`` and ``lags`` hold what they saw."""

    def __init__(self, cluster, server, cfg: SoakConfig, base: float):
        self.cluster, self.server, self.cfg, self.base = cluster, server, cfg, base
        self.samples: list[dict] = []
        self.lags: list[float] = []
        self._worst = 0.0  # the worst lag since the last sample
        self.settled = False  # set once the soak has settled: its samples give RSS's end level

    async def lag_loop(self) -> None:
        while True:
            lag = await overslept(self.cfg.lag_period_s)
            self.lags.append(lag)
            self._worst = max(self._worst, lag)

    async def run(self) -> None:
        while True:
            self.take()
            await asyncio.sleep(self.cfg.sample_period_s)

    def take(self) -> dict:
        cl = self.cluster
        t = cl.clock.now() - self.base
        level = self.settled or self.cfg.warmup <= t < self.cfg.warmup + LEVEL_WINDOW_S
        trimmed = level and release_freed_memory()  # the samples rss_growth compares read live memory
        connections = getattr(getattr(self.server.runner, "server", None), "connections", None)
        sample = {"t": t, "rss_bytes": rss_bytes(), "heap_trimmed": trimmed, "open_sockets": open_sockets(),
                  "server_connections": None if connections is None else len(connections),
                  "requests": len(cl.requests), "loop_lag_s": self._worst,
                  "free_blocks": {iid: i.blocks.num_free for iid, i in cl.instances.items() if i.state != "removed"},
                  "states": {iid: i.state for iid, i in cl.instances.items()}}
        self._worst = 0.0
        self.samples.append(sample)
        return sample
