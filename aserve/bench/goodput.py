"""``aserve bench goodput``: per system, the highest arrival rate at which >= 90% of requests are good.

Goodput (DistServe, OSDI'24) is the highest request rate a system serves while a target share of
requests (90%) meets every SLO (aserve/replay/slo.py), per device it runs on. The same trace's
requests (same lengths, same prompts) are re-timed to each probed rate (a timed trace keeps the
shape of its arrivals, rescaled; an untimed one gets Poisson arrivals, or Gamma with
``--burstiness``) and replayed on a fresh cluster; attainment is the share of good requests.

    search, per system (at most --max-points replays; it says how many it ran):
      start (the trace's own rate, --rate-start, or on a real device the knee a simulation of it
            on this machine's profile predicts)
      x2 up while attainment >= target, /2 down while below  -> a bracket [good, bad)
      geometric bisection until bad / good <= 1 + --precision -> the knee = good, its error bar = bad - good

On a real device one replay is one draw of the machine's minutes: near the knee of a bursty trace
the attainment curve is flat, a few requests either side of the target over a wide range of rates,
and the same system at the same rate passes one draw and fails the next. ``--repeats K`` replays
each probed rate K times and pools them (``pooled``: the good requests of every replay over all
their requests), so a point is decided on K times the requests; each replay's own attainment is
kept beside the pooled one. A simulated device replays the same way every time, so there it is refused.

The search never runs unbounded: at ``floor`` (every request arrives after the one before it
would have finished alone) a failing system is reported as unable to meet the SLO at any rate; above ``ceiling`` (the whole trace arrives within one median prompt's
prefill: raising the rate changes nothing) a passing one as too little load to find its knee
(a longer trace is needed). This module is the search and the replays; goodput_report.py prints
and plots it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import numpy as np

from aserve.replay.slo import Slo, attainment

MIN_REQUESTS = 20  # a request is 1/N of attainment: with fewer, 90% cannot tell one miss from none


@dataclass(frozen=True)
class Point:
    """One replay at one rate."""

    rate: float
    attainment: float
    good: int
    num_requests: int
    misses: dict
    makespan_s: float
    wall_s: float
    # the prefix cache and the hand-overs at this rate (None: not measured): prompt tokens found
    # cached, blocks evicted, KV bytes moved between instances (the links' charge)
    hit_rate: Optional[float] = None
    evictions: Optional[int] = None
    kv_bytes_moved: Optional[int] = None
    ttft_mean_s: Optional[float] = None  # over the requests that got a first token
    ttft_p99_s: Optional[float] = None
    # pooled over several replays at this rate (``pooled``): good, num_requests and misses summed over
    # them, wall_s too; makespan_s and the figures above their means; ``draws`` each replay's own attainment
    draws: tuple = ()

    @property
    def repeats(self) -> int:
        return max(1, len(self.draws))

    @property
    def request_goodput(self) -> float:
        """Good requests per second of a run (of one replay, where several are pooled)."""
        return self.good / self.repeats / self.makespan_s if self.makespan_s > 0 else 0.0


PER_RUN = ("hit_rate", "evictions", "kv_bytes_moved", "ttft_mean_s", "ttft_p99_s")  # a run's figures: pooled by their mean


def pooled(points: Sequence[Point]) -> Point:
    """Replays of one rate as one point: every request of every replay counts once (module doc)."""
    if len(points) == 1:
        return points[0]
    rates = {p.rate for p in points}
    if len(rates) != 1:
        raise ValueError(f"pooled points must share one rate, got {sorted(rates)}")
    good, num = sum(p.good for p in points), sum(p.num_requests for p in points)
    misses = {k: sum(p.misses.get(k, 0) for p in points) for k in points[0].misses}

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    return Point(points[0].rate, good / num if num else 0.0, good, num, misses,
                 makespan_s=mean(p.makespan_s for p in points), wall_s=sum(p.wall_s for p in points),
                 draws=tuple(p.attainment for p in points), **{k: mean(getattr(p, k) for p in points) for k in PER_RUN})


@dataclass(frozen=True)
class Knee:
    """A system's search: the highest passing rate (None: none passed), the bracket it lies in,
    why the search stopped, and every point in the order run."""

    rate: Optional[float]
    bracket: tuple  # (highest passing rate or None, lowest failing rate above it or None)
    bound: str  # within | at_least (passed at the ceiling) | below (failed at the floor) | max_points
    points: tuple = field(default_factory=tuple)

    @property
    def error(self) -> Optional[float]:
        lo, hi = self.bracket
        return hi - lo if lo is not None and hi is not None else None

    target: float = 0.9

    @property
    def monotone(self) -> bool:
        """No failing point below a passing one (noise near the knee can break it; said, not hidden)."""
        passed = [p.rate for p in self.points if p.attainment >= self.target]
        failed = [p.rate for p in self.points if p.attainment < self.target]
        return not passed or not failed or min(failed) > max(passed)


@dataclass(frozen=True)
class Limits:
    """The search's bounds (req/s) and its stopping rule."""

    start: float
    floor: float
    ceiling: float
    target: float = 0.9
    precision: float = 0.05
    max_points: int = 12
    factor: float = 2.0

    def __post_init__(self):
        if not 0 < self.target <= 1:
            raise ValueError(f"--target is a share of requests in (0, 1], got {self.target}")
        if not self.precision > 0:
            raise ValueError(f"--precision must be > 0 (the knee's relative error bar), got {self.precision}")
        if self.max_points < 3:
            raise ValueError(f"--max-points must be >= 3 (a bracket and one step in it), got {self.max_points}")
        if not 0 < self.floor < self.ceiling:
            raise ValueError(f"bad search bounds: floor {self.floor:g} and ceiling {self.ceiling:g} req/s")


def search(probe: Callable[[float], Point], lim: Limits) -> Knee:
    """Bracket the knee by doubling or halving from ``lim.start``, then bisect (module doc)."""
    points: list[Point] = []

    def passes(rate: float) -> bool:
        points.append(probe(rate))
        return points[-1].attainment >= lim.target

    good: Optional[float] = None
    bad: Optional[float] = None
    rate = min(max(lim.start, lim.floor), lim.ceiling)
    good, bad = (rate, None) if passes(rate) else (None, rate)
    while (good is None or bad is None) and len(points) < lim.max_points:
        if good is None:
            if bad <= lim.floor:
                break
            rate = max(lim.floor, bad / lim.factor)
        else:
            if good >= lim.ceiling:
                break
            rate = min(lim.ceiling, good * lim.factor)
        if passes(rate):
            good = rate
        else:
            bad = rate
    while good is not None and bad is not None and bad / good > 1 + lim.precision and len(points) < lim.max_points:
        mid = math.sqrt(good * bad)  # geometric: rates span orders of magnitude
        if passes(mid):
            good = mid
        else:
            bad = mid
    if good is None:
        bound = "below" if bad <= lim.floor else "max_points"
    elif bad is None:
        bound = "at_least" if good >= lim.ceiling else "max_points"
    else:
        bound = "within" if bad / good <= 1 + lim.precision else "max_points"
    return Knee(good, (good, bad), bound, tuple(points), lim.target)


def search_bounds(slo: Slo, requests: Sequence) -> tuple[float, float]:
    """``(floor, ceiling)`` in req/s from the device's unloaded costs (module doc); ``requests``
    re-timed to 1 req/s (every probed rate divides their gaps by itself).

    The floor is where every request arrives after the one before it would have finished alone
    (requests arriving together stay together at any rate: a bursty trace is bursty at every
    rate, so a mean gap would not do: on the Azure code trace 41% of gaps are under 5% of the mean)."""
    costs = slo.costs
    n = len(requests)
    e2e = [costs.alone(r.prompt_tokens, r.output_tokens)["e2el"] for r in requests]
    gaps = [(b.arrival_s - a.arrival_s) / t for a, b, t in zip(requests, requests[1:], e2e) if b.arrival_s > a.arrival_s]
    prefill = float(np.median([costs.prefill_s(r.prompt_tokens) for r in requests]))
    floor = min(gaps, default=1.0 / float(np.mean(e2e)))
    return max(floor, 1e-9), (n - 1) / max(prefill, 1e-6)


def check_trace(requests: Sequence, source: str) -> None:
    """A trace too short to find a knee is refused before any replay."""
    if len(requests) < MIN_REQUESTS:
        raise ValueError(f"trace {source} has {len(requests)} requests after fitting: a goodput search needs at "
                         f"least {MIN_REQUESTS} (each request is 1/N of attainment, so with fewer a 90% target cannot "
                         f"tell one miss from none); use a longer trace or --num-requests >= {MIN_REQUESTS}")


def check_meetable(slo: Slo, requests: Sequence, target: float) -> None:
    """Refuse an SLO that fewer than ``target`` of the requests could meet even alone on the
    device (no rate can reach the target then), naming what would work."""
    share = slo.meetable_share(requests)
    if share >= target:
        return
    alone = [slo.costs.alone(r.prompt_tokens, r.output_tokens) for r in requests]
    limits = [slo.limits(r.prompt_tokens, r.output_tokens) for r in requests]
    worst = []
    for key, term in slo.terms:
        ok = sum(a[key] <= lim[key] for a, lim in zip(alone, limits)) / len(requests)
        if ok >= target:
            continue
        need = float(np.quantile([a[key] / lim[key] for a, lim in zip(alone, limits)], target))
        if term.relative:
            fix = f"about {need:.2g}x its multipliers"
        else:
            fix = f"{key}:{math.ceil(term.seconds * need * 1000)} ms or more"
        worst.append(f"{key} <= {term.text(key)}: {ok:.0%} of requests meet it alone ({fix} would let {target:.0%})")
    raise ValueError(f"SLO {slo.name} cannot be met by {target:.0%} of these requests at any rate: alone on "
                     f"{slo.costs.device} only {share:.0%} would; " + "; ".join(worst))


def replay_point(spec, trace, prompts, bundle, slo: Slo, rate: float, run_loop, progress=None,
                 timeout_s: Optional[float] = None) -> Point:
    """One replay of ``trace`` (already re-timed to ``rate``) on a fresh cluster of ``spec``."""
    from aserve.replay.driver import SystemSpec, replay_cluster
    from aserve.replay.report import summarize

    wall0 = time.perf_counter()
    run = run_loop(replay_cluster(SystemSpec(f"{spec.name} @ {rate:.3g} req/s", spec.engine, spec.cluster),
                                  trace, prompts, bundle, progress, True, timeout_s))
    a = attainment(run.records, slo)
    s = summarize(run)
    return Point(rate, a["slo_attainment"], a["good"], a["num_requests"], a["misses"], s["makespan_s"],
                 time.perf_counter() - wall0, s["prefix_cache_hit_rate"], s["prefix_cache_evictions"],
                 s["kv_bytes_charged"], (s["ttft"] or {}).get("mean"), (s["ttft"] or {}).get("p99"))


def simulated(spec, device: str):
    """``spec`` on a simulated device (its settings as derived for the real one)."""
    return replace(spec, engine=replace(spec.engine, device=device))
