"""The live monitor's maths: snapshots parsed, counters turned into rates, histograms into
quantiles. Pure functions: no I/O, no clock, no rich (aserve/monitor/history.py keeps the
samples and makes the rows).

    /v1/stats JSON + /metrics text ──sample_from──► Sample

Rates come from counter deltas between the last two samples over the server's own uptime
clock, so a slow poll never inflates them. Latency quantiles come from Prometheus histogram
*bucket deltas* over a sliding window, as ``histogram_quantile(rate(..._bucket[30s]))`` does:
an average of percentiles is not a percentile, so per-instance histograms are summed bucket by
bucket before any quantile is taken.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

TTFT = "vllm:time_to_first_token_seconds"
TBT = "vllm:inter_token_latency_seconds"
HISTOGRAMS = (TTFT, TBT)
SPARK = "▁▂▃▄▅▆▇█"


# ---- histograms ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Histogram:
    """Cumulative counts ``((upper_bound, count), ...)`` sorted by bound, ``+inf`` last."""

    buckets: tuple[tuple[float, float], ...]

    @property
    def total(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0


def parse_histograms(text: str, names: tuple[str, ...] = HISTOGRAMS) -> dict[str, Histogram]:
    """The named histograms of a Prometheus text page, each summed over its label sets."""
    out: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram" or family.name not in names:
            continue
        sums: dict[float, float] = {}
        for s in family.samples:
            if s.name.endswith("_bucket"):
                bound = float(s.labels["le"])
                sums[bound] = sums.get(bound, 0.0) + s.value
        out[family.name] = Histogram(tuple(sorted(sums.items())))
    return out


def histogram_delta(old: Optional[Histogram], new: Histogram) -> Histogram:
    """Observations that arrived between ``old`` and ``new``. A count that went down means the
    server restarted in between: then everything in ``new`` is new."""
    if old is None:
        return new
    before = dict(old.buckets)
    delta = tuple((b, c - before.get(b, 0.0)) for b, c in new.buckets)
    if any(c < 0 for _, c in delta):
        return new
    return Histogram(delta)


def histogram_quantile(q: float, h: Histogram) -> Optional[float]:
    """The ``q`` quantile by linear interpolation inside its bucket, as Prometheus computes it.

    The first bucket's lower edge is 0; a rank that lands in ``+inf`` answers the highest finite
    bound (all that is known). None when the histogram holds no observation.
    """
    assert 0 < q <= 1, q
    if h.total <= 0:
        return None
    rank = q * h.total
    lower, below = 0.0, 0.0
    for bound, count in h.buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            # count > below here: rank > below, or an earlier bucket would have held it
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def p50_p99(h: Optional[Histogram]) -> tuple[Optional[float], Optional[float]]:
    if h is None:
        return None, None
    return histogram_quantile(0.5, h), histogram_quantile(0.99, h)


# ---- samples and rates -------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One poll: the /v1/stats JSON, its parsed histograms, and the local wall time it was taken."""

    stats: dict
    histograms: dict[str, Histogram]
    wall: float

    @property
    def time(self) -> float:
        """The server's uptime: the clock every rate is measured on."""
        return float(self.stats.get("uptime_s", 0.0))


def sample_from(stats: dict, metrics_text: str, wall: float) -> Sample:
    return Sample(stats, parse_histograms(metrics_text), wall)


def rate(old: Optional[float], new: Optional[float], dt: float) -> Optional[float]:
    """Per-second change of a counter; None without two readings, over no time, or on a reset."""
    if old is None or new is None or dt <= 0 or new < old:
        return None
    return (new - old) / dt


def sparkline(values: list[float], width: int) -> str:
    """The last ``width`` values as unicode blocks, scaled to their own maximum."""
    values = values[-width:]
    top = max(values, default=0.0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, round(v / top * (len(SPARK) - 1)))] for v in values)
