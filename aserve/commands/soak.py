"""``aserve soak``: a long replay with faults in combination; exit 1 when a request was lost or a
block leaked (aserve/soak/).

    aserve soak [TRACE] --duration SECONDS --json FILE [--plot FILE] [--faults kill,flip,...]
                [trace fitting flags] [engine and cluster flags]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from aserve.commands.common import add_cluster_args, add_engine_args, engine_and_cluster
from aserve.commands.replay import add_fit_args, fit_options
from aserve.event_loop import run as run_loop


def register(subparsers) -> None:
    from aserve.soak.settings import FAULTS

    p = subparsers.add_parser("soak", help="long replay with faults injected in combination: lost requests, leaked "
                              "blocks, RSS growth, loop lag, recovery per kill (JSON and a plot)")
    p.add_argument("trace", nargs="?", default="traces/Mixed.jsonl",
                   help="any trace 'aserve replay' reads, cycled for the duration (default traces/Mixed.jsonl)")
    p.add_argument("--duration", type=float, required=True, help="seconds of load and faults")
    p.add_argument("--json", required=True, help="write the report here")
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    p.add_argument("--prompts", default=None, help="JSONL with 'prompt' text (default: random token ids)")
    p.add_argument("--name", default=None, help="the system's name in the report")
    s = p.add_argument_group("soak")
    s.add_argument("--warmup", type=float, default=None, help="RSS growth is measured after this (default: a tenth "
                   "of the duration, 60 s at most)")
    s.add_argument("--sample-period", type=float, default=1.0, help="seconds between samples")
    s.add_argument("--cut-fraction", type=float, default=1 / 3,
                   help="requests cut at a random point of their stream: half disconnects, half aborts")
    s.add_argument("--fault-interval", type=float, default=10.0, help="mean seconds between fault events")
    s.add_argument("--combine", type=float, default=0.3, help="probability that an event injects two faults at once")
    s.add_argument("--faults", default=",".join(FAULTS),
                   help=f"server-side faults, comma-separated: {', '.join(FAULTS)} (none: client cuts only)")
    s.add_argument("--readd-after", type=float, nargs=2, default=(5.0, 20.0), metavar=("MIN", "MAX"),
                   help="seconds after a kill until the instance is replaced")
    s.add_argument("--max-in-flight", type=int, default=32, help="the client waits for a slot beyond this")
    s.add_argument("--drain-timeout", type=float, default=300.0,
                   help="after the duration: seconds requests in flight get before the server aborts them")
    add_fit_args(p)
    add_engine_args(p)
    add_cluster_args(p)
    p.set_defaults(func=cmd_soak, predictor="oracle")  # a robustness run, no comparison: as before issue 54


def soak_config(a: argparse.Namespace):
    from aserve.soak.settings import SoakConfig

    faults = tuple(f.strip() for f in a.faults.split(",") if f.strip() and f.strip() != "none")
    return SoakConfig(duration_s=a.duration, warmup_s=a.warmup, sample_period_s=a.sample_period,
                      cut_fraction=a.cut_fraction, fault_interval_s=a.fault_interval, combine_p=a.combine,
                      readd_after_s=tuple(a.readd_after), faults=faults, max_in_flight=a.max_in_flight,
                      drain_s=a.drain_timeout, seed=a.seed)


def cmd_soak(a: argparse.Namespace) -> int:
    from aserve.engine.bundle import ModelBundle
    from aserve.replay.driver import SystemSpec, default_name
    from aserve.replay.report import write_json
    from aserve.replay.traces import load_trace
    from aserve.replay.workloads import PromptBuilder
    from aserve.soak.report import print_summary, write_plot
    from aserve.soak.run import soak

    (engine, cluster), cfg = engine_and_cluster(a), soak_config(a)
    spec = SystemSpec(a.name or default_name(engine, cluster), engine, cluster)
    bundle = ModelBundle.load(engine)
    builder = PromptBuilder(bundle.tokenizer, Path(a.prompts) if a.prompts else None, a.seed)
    trace = load_trace(a.trace, fit_options(a, bundle.args.max_position),
                       lambda text: len(bundle.tokenizer.encode(text, add_special_tokens=False)))
    report = run_loop(soak(spec, cfg, trace, builder.build(trace.requests), bundle))
    report["trace"] = trace.summary()
    print_summary(report)
    print(f"wrote {write_json(report, a.json)}")
    if a.plot:
        print(f"wrote {write_plot(report, a.plot)}")
    return 0 if report["ok"] else 1
