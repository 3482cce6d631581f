"""``aserve predictor share``: every backend's share of the oracle's scheduling gain, over seeds.

    aserve predictor share --out DIR [--backends sklearn,lm,retrieval --seeds 0,1,2
        --policies reserve-dynamic,reserve-static --trace-args '...' --system-args '...'
        --replay-args '...' --metric jct --json share.json] [--dry-run]

Runs the grid of replays ``aserve/replay/share.py`` describes, one process each, skipping those
whose JSON is already in DIR (stop it and run it again to resume), then prints per policy and
backend the mean share and its spread. ``--dry-run`` prints the commands and runs nothing.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from aserve.replay.share import POLICIES, ShareStudy

CLI = Path(__file__).resolve().parents[2] / "cli.py"  # run as a program, never imported
# Calibrated so KV binds (docs/notes/predictors.md, issue 25 "Calibration"): at 0.1 GiB and 2 req/s nothing was
# preempted and the oracle was 5% worse than greedy; at 0.05 GiB and 3 req/s it cut mean JCT by 31%.
DEFAULT_SYSTEM = "--mode disagg --prefill 1 --decode 2 --dispatch interference --kv-cache-gb 0.05 --predictor-timeout 3"
DEFAULT_TRACE = "--num-requests 96 --rate 3"


def add_share_parser(psub) -> None:
    s = psub.add_parser("share", help="replay none, oracle and every backend over seeds: each backend's share of "
                                      "the oracle's gain in JCT, mean and spread")
    s.add_argument("--out", required=True, help="folder for the traces and every replay's JSON (resumable)")
    s.add_argument("--backends", default="sklearn,lm,retrieval", help="comma-separated")
    s.add_argument("--policies", default=",".join(POLICIES), help="comma-separated reservation policies")
    s.add_argument("--seeds", default="0,1,2", help="comma-separated; each a trace and an engine seed")
    s.add_argument("--trace-args", default=DEFAULT_TRACE, help="'aserve predictor trace' flags")
    s.add_argument("--system-args", default=DEFAULT_SYSTEM,
                   help="cluster and engine flags every system shares (KV must bind: see --kv-cache-gb)")
    s.add_argument("--replay-args", default="--chat", help="'aserve replay' flags (--chat: as the labels were made)")
    s.add_argument("--metric", default="jct", help="the replay report's latency to compare: jct | normalized_latency")
    s.add_argument("--json", default=None, help="also write the summary here")
    s.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    s.set_defaults(func=cmd_share)


def _list(text: str, field: str, kind=str) -> tuple:
    try:
        return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"field {field!r}: expected a comma-separated list, got {text!r}") from None


def cmd_share(a: argparse.Namespace) -> int:
    study = ShareStudy(Path(a.out), _list(a.backends, "backends"), _list(a.policies, "policies"),
                       _list(a.seeds, "seeds", int), a.trace_args, a.system_args, a.replay_args, a.metric)
    steps = study.commands([sys.executable, str(CLI)])
    failed = []
    for path, argv in steps:
        if path.is_file():
            continue
        print(shlex.join(argv), flush=True)
        if a.dry_run:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if subprocess.run(argv).returncode != 0:
            failed.append(str(path.relative_to(study.out)))  # failed requests: its JSON is written, say so
    if a.dry_run:
        return 0
    summary = study.summarize()
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    _print(summary, failed)
    return 0


def _print(summary: dict, failed: list) -> None:
    from rich.console import Console
    from rich.table import Table

    def pct(v) -> str:
        return "n/a" if v is None else f"{v:.0%}"

    table = Table(title=f"share of the oracle's gain in mean {summary['metric']}: (none - B) / (none - oracle)")
    for col in ("policy", "backend", "seeds", "mean", "std", "min", "max", "per seed"):
        table.add_column(col, justify="right")
    for policy, rows in summary["policies"].items():
        for b, r in rows.items():
            table.add_row(policy, b, str(r["n"]), pct(r["mean"]), pct(r["std"]), pct(r["min"]), pct(r["max"]),
                          " ".join(f"{s}:{pct(v)}" for s, v in r["per_seed"].items()))
    Console().print(table)
    means = Table(title=f"mean {summary['metric']} per system and seed, s")
    seeds = sorted({s for row in summary["means"].values() for s in row}, key=int)
    for col in ("system", *(f"seed {s}" for s in seeds)):
        means.add_column(col, justify="right")
    for name, row in summary["means"].items():
        means.add_row(name, *("-" if row.get(s) is None else f"{row[s]:.2f}" for s in seeds))
    Console().print(means)
    if failed:
        print(f"replays that exited non-zero (see their JSON): {', '.join(failed)}")
