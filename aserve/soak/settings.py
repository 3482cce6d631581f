"""The soak's own knobs (the engine's and the cluster's are EngineConfig / ClusterConfig)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

FAULTS = ("transfer_fail", "transfer_stall", "kill", "flip")
DISAGG_ONLY = ("transfer_fail", "transfer_stall", "flip")  # a coupled cluster has no hand-over to break


@dataclass(frozen=True)
class SoakConfig:
    """How long, how hard, and which faults.

    ``cut_fraction`` of the requests are cut at a random point of their stream, half by the client
    going away (a disconnect), half by an abort the server is asked for; a fault event comes every
    ``fault_interval_s`` on average (exponential gaps) and injects one fault, or two different
    ones at once with probability ``combine_p``; a killed instance is removed and a new one of its
    role added ``readd_after_s`` (a range) later.
    """

    duration_s: float
    warmup_s: Optional[float] = None  # RSS growth is measured after it (default: a tenth, 60 s at most)
    sample_period_s: float = 1.0
    lag_period_s: float = 0.05  # the loop-lag probe's sleep: one lag value each
    cut_fraction: float = 1 / 3
    stream_fraction: float = 0.8  # the others ask for one JSON answer (their cut: a disconnect only)
    fault_interval_s: float = 10.0
    combine_p: float = 0.3
    readd_after_s: tuple = (5.0, 20.0)
    faults: tuple = FAULTS
    max_in_flight: int = 32  # the client waits for a slot past this (an overloaded server's queue would only grow)
    drain_s: float = 300.0  # after the duration: how long requests in flight get to end before they are aborted
    seed: int = 0

    def __post_init__(self):
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        for name in ("sample_period_s", "lag_period_s", "fault_interval_s", "drain_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.warmup_s is not None and not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s must be in [0, duration_s), got {self.warmup_s}")
        for name in ("cut_fraction", "stream_fraction", "combine_p"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        lo, hi = self.readd_after_s
        if not 0 <= lo <= hi:
            raise ValueError(f"readd_after_s must be a range 0 <= lo <= hi, got {self.readd_after_s}")
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown:
            raise ValueError(f"unknown fault {unknown[0]!r}: choose from {', '.join(FAULTS)}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else min(60.0, self.duration_s / 10)

    def faults_for(self, mode: str) -> tuple:
        """The faults that apply to a cluster of this mode."""
        return tuple(f for f in self.faults if mode == "disagg" or f not in DISAGG_ONLY)
