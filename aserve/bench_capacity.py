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

A probe passes when every request completes, P99 TBT <= ``--tbt-p99`` and median queue time
<= ``--delay-p50``. When ``--rate-hi`` passes the capacity is reported as at least that rate;
when ``--rate-lo`` fails, as below it.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import cli


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
    tbt = (summary.get("tbt") or {}).get("p99")
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


def add_capacity_parser(bsub) -> None:
    from aserve.replay_cli import _add_fit_args

    c = bsub.add_parser("capacity", help="highest request rate within a P99 TBT SLO and a median scheduling delay")
    c.add_argument("trace", help="any trace 'aserve replay' reads; its arrivals are re-drawn at each probed rate")
    c.add_argument("--compare", default=None, help="'NAME: flags ; NAME: flags' (default: the command line's system)")
    c.add_argument("--prompts", default=None, help="JSONL with 'prompt' text (default: random token ids)")
    c.add_argument("--tbt-p99", type=float, default=0.5, help="P99 time-between-tokens SLO, seconds")
    c.add_argument("--delay-p50", type=float, default=2.0, help="median scheduling delay limit, seconds")
    c.add_argument("--rate-lo", type=float, default=0.05, help="lowest rate probed, req/s")
    c.add_argument("--rate-hi", type=float, default=4.0, help="highest rate probed, req/s")
    c.add_argument("--steps", type=int, default=5, help="bisection steps between them")
    c.add_argument("--timeout", type=float, default=None, help="per probe: abort what is left after this many s")
    c.add_argument("--json", default=None, help="write the results here")
    c.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    _add_fit_args(c)
    cli.add_engine_args(c)
    cli.add_cluster_args(c)
    c.set_defaults(func=cmd_capacity)


def cmd_capacity(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from aserve.aio import run as run_loop
    from aserve.engine import ModelBundle
    from aserve.replay import ReplayProgress, SystemSpec, default_name, replay_cluster
    from aserve.replay_cli import fit_options, parse_compare
    from aserve.report import summarize
    from aserve.trace_formats import read_trace
    from aserve.traces import fit
    from aserve.workloads import PromptBuilder

    if a.rate is not None:
        raise ValueError("--rate is what bench capacity searches: use --rate-lo and --rate-hi")
    if a.tbt_p99 <= 0 or a.delay_p50 <= 0:
        raise ValueError(f"--tbt-p99 and --delay-p50 must be > 0, got {a.tbt_p99}, {a.delay_p50}")
    engine = cli.engine_config(a)
    specs = (parse_compare(a.compare, a) if a.compare else
             [SystemSpec(default_name(engine, cli.cluster_config(a)), engine, cli.cluster_config(a))])
    bundle = ModelBundle.load(engine)
    # read (and count text prompts) once; each probe only re-times the same requests
    raw = read_trace(a.trace, lambda text: len(bundle.tokenizer.encode(text, add_special_tokens=False)))

    def fitted(rate: float):
        return fit(raw, fit_options(a, bundle.args.max_position, rate=rate, time_scale=1.0), str(a.trace))

    first = fitted(a.rate_lo)
    prompts = PromptBuilder(bundle.tokenizer, Path(a.prompts) if a.prompts else None, a.seed).build(first.requests)
    console = Console()
    results = {}
    with ReplayProgress(a.progress) as progress:
        for spec in specs:
            def probe(rate: float, spec=spec) -> Probe:
                trace = fitted(rate)
                run = run_loop(replay_cluster(SystemSpec(f"{spec.name} @ {rate:.3g} req/s", spec.engine, spec.cluster),
                                              trace, prompts, bundle, progress, True, a.timeout))
                p = judge(summarize(run), len(trace.requests), rate, a.tbt_p99, a.delay_p50)
                console.log(f"{spec.name}: {rate:.3g} req/s -> {'pass' if p.passed else 'fail'} "
                            f"(P99 TBT {_s(p.tbt_p99_s)}, median delay {_s(p.delay_p50_s)}, "
                            f"{p.completed}/{p.num_requests} done)")
                return p

            cap, bound, probes = bisect_capacity(probe, a.rate_lo, a.rate_hi, a.steps)
            results[spec.name] = {"capacity_rps": cap, "bound": bound, "probes": [asdict(p) for p in probes]}
    base = next(iter(results.values()))["capacity_rps"]
    for r in results.values():
        r["capacity_vs_first"] = r["capacity_rps"] / base if base and r["capacity_rps"] else None
    table = Table(title=f"capacity: P99 TBT <= {a.tbt_p99} s, median scheduling delay <= {a.delay_p50} s")
    for col in ("system", "capacity req/s", "vs first", "probes"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, r in results.items():
        cap = "n/a" if r["capacity_rps"] is None else f"{r['capacity_rps']:.3g}"
        cap = {"at_least": f">= {cap}", "below": f"< {a.rate_lo:.3g}"}.get(r["bound"], cap)
        ratio = "n/a" if r["capacity_vs_first"] is None else f"x{r['capacity_vs_first']:.2f}"
        table.add_row(name, cap, ratio, str(len(r["probes"])))
    console.print(table)
    if a.json:
        out = {"trace": {"path": a.trace, "num_requests": len(first.requests), "burstiness": a.burstiness},
               "slo": {"tbt_p99_s": a.tbt_p99, "delay_p50_s": a.delay_p50},
               "search": {"rate_lo": a.rate_lo, "rate_hi": a.rate_hi, "steps": a.steps}, "systems": results}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2))
        console.print(f"wrote {a.json}")
    return 0


def _s(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.3f} s"
