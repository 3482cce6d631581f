#!/usr/bin/env python3
"""Two runs' JSON reports side by side, with the difference of the second against the first.

    scripts/side_by_side.py A.json B.json [--label-a old --label-b new] [--limit 5]

Works on `aserve replay --json` reports (every system, latency means and tails, busy time, perf/$)
and on `aserve bench engine --json` reports (the throughputs and ratios it prints). Prints a
markdown table for the notes (docs/notes/); `--limit P` marks every cell whose difference is over
P percent with `!`, so a refactor's before/after or a simulation's error against a real run is
read at a glance. Reports from before TPOT and token gaps were told apart name the per-request
mean `tbt`; it is read as `tpot`. Many workloads' real-against-simulated errors in one table, with
the token gap and separate limits for means and P99s: benchmarks/sim_validation.py (which uses this
file's `latency` and `pct_diff`).
"""
from __future__ import annotations

import argparse
import json
import sys

REPLAY_CELLS = (("TTFT mean", "ttft", "mean"), ("TTFT P99", "ttft", "p99"),
                ("TPOT mean", "tpot", "mean"), ("TPOT P99", "tpot", "p99"),
                ("JCT mean", "jct", "mean"), ("JCT P99", "jct", "p99"))
REPLAY_SCALARS = (("busy s", "resource_usage_s"), ("out tok/s", "output_tokens_per_s"))
ENGINE_CELLS = (("generate tok/s", ("aserve_generate_tokens_per_s",)), ("generate vs HF", ("generate_speedup",)),
                ("decode step vs roofline", ("decode_step_vs_roofline",)),
                ("prefill 128 tok/s", ("prefill", "128", "tokens_per_s")),
                ("prefill 512 tok/s", ("prefill", "512", "tokens_per_s")),
                ("decode b1 tok/s", ("decode", "1", "tokens_per_s")),
                ("decode b32 tok/s", ("decode", "32", "tokens_per_s")))


def _dig(d, path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def latency(system: dict, key: str, stat: str):
    block = system.get(key) or (system.get("tbt") if key == "tpot" else None)
    return None if not block else block.get(stat)


def pct_diff(a, b):
    """``b`` against ``a`` in percent; None if either is missing, inf if only ``a`` is 0."""
    if a is None or b is None:
        return None
    if a == 0:
        return 0.0 if b == 0 else float("inf")
    return 100.0 * (b - a) / abs(a)


def _diff(a, b, limit):
    pct = pct_diff(a, b)
    if pct is None:
        return "n/a"
    if a == 0:
        return "0%" if b == 0 else "inf"
    return f"{pct:+.1f}%" + (" !" if limit is not None and abs(pct) > limit else "")


def _fmt(v):
    return "n/a" if v is None else (f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}")


def replay_rows(a: dict, b: dict, la: str, lb: str, limit):
    cols = [c[0] for c in REPLAY_CELLS] + [c[0] for c in REPLAY_SCALARS]
    print("| system | run | " + " | ".join(cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    for name in a["systems"]:
        if name not in b["systems"]:
            continue
        sa, sb = a["systems"][name], b["systems"][name]
        va = [latency(sa, k, s) for _, k, s in REPLAY_CELLS] + [sa.get(k) for _, k in REPLAY_SCALARS]
        vb = [latency(sb, k, s) for _, k, s in REPLAY_CELLS] + [sb.get(k) for _, k in REPLAY_SCALARS]
        print(f"| {name} | {la} | " + " | ".join(_fmt(v) for v in va) + " |")
        print(f"|  | {lb} | " + " | ".join(_fmt(v) for v in vb) + " |")
        print("|  | diff | " + " | ".join(_diff(x, y, limit) for x, y in zip(va, vb)) + " |")


def engine_rows(a: dict, b: dict, la: str, lb: str, limit):
    print(f"| figure | {la} | {lb} | diff |")
    print("|---|---:|---:|---:|")
    for label, path in ENGINE_CELLS:
        x, y = _dig(a, path), _dig(b, path)
        print(f"| {label} | {_fmt(x)} | {_fmt(y)} | {_diff(x, y, limit)} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--label-a", default="A")
    p.add_argument("--label-b", default="B")
    p.add_argument("--limit", type=float, default=None, help="mark differences over this many percent")
    args = p.parse_args(argv)
    try:
        a, b = (json.load(open(path)) for path in (args.a, args.b))
    except (OSError, json.JSONDecodeError) as e:
        print(f"side_by_side: cannot read a report: {e}", file=sys.stderr)
        return 2
    if "systems" in a and "systems" in b:
        replay_rows(a, b, args.label_a, args.label_b, args.limit)
    elif "prefill" in a and "prefill" in b:
        engine_rows(a, b, args.label_a, args.label_b, args.limit)
    else:
        print("side_by_side: both files must be replay reports or both engine reports", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
