"""``aserve bench capacity``: the highest request rate each system sustains within its SLOs.

Sarathi-Serve §5.1 defines capacity as the largest arrival rate at which a system keeps the
P99 time between tokens under an SLO and the median scheduling delay (arrival to first
scheduling: our ``queue_time``) under a limit. This command finds it by bisection: the same
trace's requests (same lengths, same prompts) are re-timed to each probed mean rate (a timed
trace keeps the shape of its arrivals, rescaled; an untimed one gets Poisson arrivals, or
Gamma with ``--burstiness``) and replayed in-process on a fresh cluster per probe.

    aserve bench capacity TRACE --compare 'tetri: ... ; sarathi: ...' [--tbt-p99 0.5]
                                [--delay-p50 2] [--rate-lo 0.05] [--rate-hi 4] [--steps 5]
                                [fit flags] [engine and cluster flags] [--json FILE]

A probe passes when every request completes, the P99 token gap <= ``--tbt-p99`` and median queue time
<= ``--delay-p50``. When ``--rate-hi`` passes the capacity is reported as at least that rate;
when ``--rate-lo`` fails, as below it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional


@dataclass(frozen=True)
class Probe:
    rate: float
    passed: bool
    tbt_p99_s: Optional[float]
    delay_p50_s: Optional[float]
    completed: int
    num_requests: int


def judge(summary: dict, num_requests: int, rate: float, tbt_p99: float, delay_p50: float) -> Probe:
    """A replay's summary against the SLOs (see the module docstring)."""
    tbt = (summary.get("token_gap") or {}).get("p99")
    delay = (summary.get("queue_time") or {}).get("p50")
    ok = (summary["completed"] == num_requests and tbt is not None and tbt <= tbt_p99
          and (delay is None or delay <= delay_p50))
    return Probe(rate, ok, tbt, delay, summary["completed"], num_requests)


def bisect_capacity(probe: Callable[[float], Probe], lo: float, hi: float, steps: int) -> tuple[Optional[float], str, list]:
    """``(capacity, bound, probes)``. ``bound`` is ``within`` (capacity is the best passing rate
    found), ``at_least`` (``hi`` passed) or ``below`` (``lo`` failed: capacity None)."""
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < --rate-lo < --rate-hi, got {lo}, {hi}")
    if steps < 0:
        raise ValueError(f"--steps must be >= 0, got {steps}")
    probes = [probe(hi)]
    if probes[-1].passed:
        return hi, "at_least", probes
    probes.append(probe(lo))
    if not probes[-1].passed:
        return None, "below", probes
    good, bad = lo, hi
    for _ in range(steps):
        mid = (good * bad) ** 0.5  # geometric: rates span orders of magnitude
        probes.append(probe(mid))
        if probes[-1].passed:
            good = mid
        else:
            bad = mid
    return good, "within", probes


def run_capacity(specs, trace_path: str, fitted, prompts_path: Optional[str], bundle,
                 tbt_p99: float, delay_p50: float, rate_lo: float, rate_hi: float, steps: int,
                 timeout_s: Optional[float], json_path: Optional[str], burstiness: float, seed: int,
                 progress: bool = True) -> dict:
    """Bisect each system's capacity; print the table and write ``json_path``. ``fitted(rate)``
    is the trace's requests re-timed to ``rate`` req/s."""
    from rich.console import Console
    from rich.table import Table

    from aserve.event_loop import run as run_loop
    from aserve.replay.driver import ReplayProgress, SystemSpec, replay_cluster
    from aserve.replay.report import summarize
    from aserve.replay.workloads import PromptBuilder

    first = fitted(rate_lo)
    prompts = PromptBuilder(bundle.tokenizer, Path(prompts_path) if prompts_path else None, seed).build(first.requests)
    console = Console()
    results = {}
    with ReplayProgress(progress) as bar:
        for spec in specs:
            def probe(rate: float, spec=spec) -> Probe:
                trace = fitted(rate)
                run = run_loop(replay_cluster(SystemSpec(f"{spec.name} @ {rate:.3g} req/s", spec.engine, spec.cluster),
                                              trace, prompts, bundle, bar, True, timeout_s))
                p = judge(summarize(run), len(trace.requests), rate, tbt_p99, delay_p50)
                console.log(f"{spec.name}: {rate:.3g} req/s -> {'pass' if p.passed else 'fail'} "
                            f"(P99 token gap {_s(p.tbt_p99_s)}, median delay {_s(p.delay_p50_s)}, "
                            f"{p.completed}/{p.num_requests} done)")
                return p

            cap, bound, probes = bisect_capacity(probe, rate_lo, rate_hi, steps)
            results[spec.name] = {"capacity_rps": cap, "bound": bound, "probes": [asdict(p) for p in probes]}
    base = next(iter(results.values()))["capacity_rps"]
    for r in results.values():
        r["capacity_vs_first"] = r["capacity_rps"] / base if base and r["capacity_rps"] else None
    table = Table(title=f"capacity: P99 TBT <= {tbt_p99} s, median scheduling delay <= {delay_p50} s")
    for col in ("system", "capacity req/s", "vs first", "probes"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, r in results.items():
        cap = "n/a" if r["capacity_rps"] is None else f"{r['capacity_rps']:.3g}"
        cap = {"at_least": f">= {cap}", "below": f"< {rate_lo:.3g}"}.get(r["bound"], cap)
        ratio = "n/a" if r["capacity_vs_first"] is None else f"x{r['capacity_vs_first']:.2f}"
        table.add_row(name, cap, ratio, str(len(r["probes"])))
    console.print(table)
    out = {"trace": {"path": trace_path, "num_requests": len(first.requests), "burstiness": burstiness},
           "slo": {"tbt_p99_s": tbt_p99, "delay_p50_s": delay_p50},
           "search": {"rate_lo": rate_lo, "rate_hi": rate_hi, "steps": steps}, "systems": results}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=2))
        console.print(f"wrote {json_path}")
    return out


def _s(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.3f} s"
