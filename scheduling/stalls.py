"""Generation-stall accounting (Sarathi-Serve Fig. 1a).

A *stall* is a decode gap — the time between two consecutive output tokens of one request —
longer than ``k ×`` the median time-between-tokens. Prefill-first batching (vLLM) stalls every
running decode while a long prompt is prefilled; stall-free batching (Sarathi) should show
almost none, and a preemptive scheduler (ALISE) trades some stalls for shorter queues.

The median is taken over every gap of every request by default, so a request that is slow
throughout still counts as stalled against the instance's normal pace.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Union

TokenTimes = Union[Mapping[str, Sequence[float]], Iterable[Sequence[float]]]


@dataclass(frozen=True)
class StallStats:
    """Stalled decode gaps: how many, their total and longest length, against which median."""

    count: int
    total_s: float
    longest_s: float
    median_tbt_s: float
    num_gaps: int
    threshold_s: float

    @property
    def fraction(self) -> float:
        """Share of decode gaps that stalled."""
        return self.count / self.num_gaps if self.num_gaps else 0.0


def decode_gaps(token_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive tokens of one request. The first token's time measures the
    queue and the prefill (TTFT), not a decode, so it only opens the first gap."""
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    assert all(g >= 0 for g in gaps), "token timestamps must be non-decreasing"
    return gaps


def count_stalls(token_times: TokenTimes, k: float = 5.0,
                 median_tbt_s: Optional[float] = None) -> StallStats:
    """Count decode gaps longer than ``k × median TBT``.

    ``token_times`` is one timestamp list per request (a mapping request_id -> times, or any
    iterable of lists). ``median_tbt_s`` overrides the median (to compare policies against one
    common pace, e.g. the unloaded instance's TBT). ``total_s`` sums the stalled gaps whole.
    """
    if k <= 0:
        raise ValueError(f"k must be > 0, got {k!r}")
    per_request = token_times.values() if isinstance(token_times, Mapping) else token_times
    gaps = [g for times in per_request for g in decode_gaps(list(times))]
    if not gaps:
        return StallStats(0, 0.0, 0.0, median_tbt_s or 0.0, 0, 0.0)
    median = statistics.median(gaps) if median_tbt_s is None else median_tbt_s
    threshold = k * median
    stalled = [g for g in gaps if g > threshold]
    return StallStats(count=len(stalled), total_s=sum(stalled), longest_s=max(stalled, default=0.0),
                      median_tbt_s=median, num_gaps=len(gaps), threshold_s=threshold)
