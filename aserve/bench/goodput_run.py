"""``aserve bench goodput``'s run: every system's search (aserve/bench/goodput.py), with progress,
and on a real device a wall-time estimate first (the same search simulated on this machine's
measured profile, ``sim:local``, whose knee is also where the real search starts)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from aserve.bench.goodput import (Knee, Limits, check_meetable, check_trace, pooled, replay_point, search,
                                  search_bounds, simulated)
from aserve.replay.slo import Slo

POINT_OVERHEAD_S = 5.0  # a real point's start-up: a fresh cluster, its warm-up request, the report


@dataclass(frozen=True)
class GoodputJob:
    """What every system's search shares: the trace (``fitted(rate)`` re-times it), its prompts,
    the loaded bundle, the SLO, the stopping rule, and how replays run."""

    fitted: Callable
    prompts: Sequence
    bundle: object
    slo: Slo
    target: float
    precision: float
    max_points: int
    rate_start: Optional[float]
    run_loop: Callable  # the virtual-time loop on sim: devices, else the real one
    estimate_device: Optional[str] = None  # a real device's simulation (sim:local), None on sim:
    timeout_s: Optional[float] = None
    progress: bool = True
    repeats: int = 1  # replays a probed rate, pooled (aserve/bench/goodput.py, ``pooled``)


def devices(spec) -> int:
    c = spec.cluster
    return c.num_prefill + c.num_decode if c.split else c.num_coupled


def native_rate(requests: Sequence) -> Optional[float]:
    """A timed trace's own mean rate (None when every request arrives at once)."""
    span = requests[-1].arrival_s - requests[0].arrival_s if len(requests) > 1 else 0.0
    return (len(requests) - 1) / span if span > 0 else None


def limits_for(job: GoodputJob, requests: Sequence, start: Optional[float] = None) -> Limits:
    floor, ceiling = search_bounds(job.slo, job.fitted(1.0).requests)
    start = start or job.rate_start or native_rate(requests) or (floor * ceiling) ** 0.5
    return Limits(start, floor, ceiling, job.target, job.precision, job.max_points)


def prepare(job: GoodputJob, source: str) -> Sequence:
    """The trace's requests (lengths as fitted); refuses a trace too short or an SLO beyond reach."""
    requests = job.fitted(None).requests
    check_trace(requests, source)
    check_meetable(job.slo, requests, job.target)
    return requests


def estimate(job: GoodputJob, spec, requests, console) -> tuple[Optional[Knee], float]:
    """``(knee on the simulated device, estimated wall seconds)`` of ``spec``'s real search: the
    search from the usual start finds the simulated knee; the real one starts there, so the plan
    is the simulated search from that knee, each point as long as its simulated makespan."""
    from aserve.devices.virtual_time import run_virtual

    sim = simulated(spec, job.estimate_device)

    def probe(rate):
        return replay_point(sim, job.fitted(rate), job.prompts, job.bundle, job.slo, rate, run_virtual)

    try:
        found = search(probe, limits_for(job, requests))
    except Exception as e:  # noqa: BLE001 - an estimate that cannot run must not stop the measurement
        console.print(f"{spec.name}: no estimate ({job.estimate_device}: {type(e).__name__}: {e})")
        return None, float("nan")
    plan = search(probe, limits_for(job, requests, found.rate)) if found.rate else found
    wall = job.repeats * sum(p.makespan_s + POINT_OVERHEAD_S for p in plan.points)
    return found, wall


def run_systems(job: GoodputJob, specs: Sequence, requests: Sequence, console) -> dict:
    """Each system's ``Knee`` and wall seconds, in order: ``{name: (knee, wall_s, estimated wall_s,
    simulated knee rate)}`` (the last two None without an estimate)."""
    from aserve.replay.driver import ReplayProgress

    plans = {}
    if job.estimate_device:
        total = 0.0
        for spec in specs:
            knee, wall = estimate(job, spec, requests, console)
            plans[spec.name] = (knee, wall)
            total += wall if wall == wall else 0.0
            near = f"knee near {knee.rate:.3g} req/s" if knee and knee.rate else "no knee found there"
            console.print(f"{spec.name}: estimated wall time {wall / 60:.0f} min ({job.estimate_device}: {near})")
        each = "a real replay" if job.repeats == 1 else f"{job.repeats} real replays"
        console.print(f"[bold]estimated wall time, every system: {total / 60:.0f} min[/bold] (each point is {each} "
                      f"of {len(requests)} requests; the estimate is the search simulated on {job.estimate_device})")
    out = {}
    with ReplayProgress(job.progress and job.estimate_device is not None) as bar:
        for spec in specs:
            out[spec.name] = _search_one(job, spec, requests, plans.get(spec.name), bar, console)
    return out


def _search_one(job, spec, requests, plan, bar, console):
    started = time.perf_counter()
    sim_knee, est = plan if plan else (None, None)
    lim = limits_for(job, requests, sim_knee.rate if sim_knee and sim_knee.rate else None)
    count = [0]

    def probe(rate):
        count[0] += 1
        trace, shown = job.fitted(rate), bar if job.estimate_device else None  # the same requests each replay
        p = pooled([replay_point(spec, trace, job.prompts, job.bundle, job.slo, rate, job.run_loop, shown, job.timeout_s)
                    for _ in range(job.repeats)])
        missed = ", ".join(f"{k} {n}" for k, n in p.misses.items() if n) or "none"
        if p.repeats > 1:
            missed += f"; {p.repeats} replays pooled: " + " / ".join(f"{d:.1%}" for d in p.draws)
        left = f"; about {max(0.0, est - (time.perf_counter() - started)) / 60:.0f} min left" if est == est and est else ""
        console.log(f"{spec.name}: point {count[0]} (at most {job.max_points}) at {rate:.4g} req/s: attainment "
                    f"{p.attainment:.1%} ({p.good}/{p.num_requests}, missed {missed}) "
                    f"{'pass' if p.attainment >= job.target else 'fail'}, {p.wall_s:.1f} s{left}")
        return p

    knee = search(probe, lim)
    return knee, time.perf_counter() - started, est, sim_knee.rate if sim_knee else None


def budget_hints(specs: Sequence, slo: Slo, requests: Sequence) -> list[str]:
    """Where a system's token budget makes steps longer than the SLO's token gap: say so, and the
    ``--tbt-slo`` that sizes it for this SLO (Sarathi-Serve's rule); nothing is changed quietly."""
    terms = dict(slo.terms)
    if "token_gap" not in terms or slo.costs is None:
        return []
    r = sorted(requests, key=lambda x: x.prompt_tokens + x.output_tokens)[len(requests) // 2]
    context, gap = r.prompt_tokens + r.output_tokens, slo.limits(r.prompt_tokens, r.output_tokens)["token_gap"]
    out = []
    for spec in specs:
        chunked = spec.cluster.mode == "adaptive" or (spec.cluster.mode == "coupled" and
                                                       spec.engine.batching in ("sarathi", "alise"))
        budget = spec.engine.max_num_batched_tokens
        step = slo.costs.cost.hybrid_s(budget, 1, context)
        if chunked and step > gap:
            out.append(f"{spec.name}: its token budget ({budget}) makes a step of {step:.3g} s beside a decode at the "
                       f"median context ({context}), over the SLO's token gap there ({gap:.3g} s); --tbt-slo {gap:.3g} "
                       "sizes the budget for it (Sarathi-Serve's rule)")
    return out
