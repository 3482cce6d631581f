#!/usr/bin/env python3
"""Issue 23's validation table: the same replays on the real device and on `sim:`, cell by cell.

    benchmarks/sim_validation.py REAL_W.json:SIM_W.json [REAL_W2.json:SIM_W2.json ...] \
        [--systems tetri,vllm,sarathi] [--mean-limit 0.10] [--p99-limit 0.20]

Each argument pairs two `aserve replay --compare` reports of one workload (the workload's name is
the real file's stem without a leading `run_`). For every system in both, one markdown row: mean
and P99 of TTFT, TBT (the gap between two tokens of a request) and JCT as real / simulated
(error), and the summed busy seconds. A mean off by more than --mean-limit or a P99 by more than
--p99-limit is marked `!`; the last line counts them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # side_by_side.py, a tool
from side_by_side import latency, pct_diff  # noqa: E402

METRICS = (("ttft", "TTFT"), ("token_gap", "TBT"), ("jct", "JCT"))


def fmt(x: float) -> str:
    return "n/a" if x is None else f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def cell(real: float, sim: float, limit: float) -> tuple[str, bool]:
    err = pct_diff(real, sim)
    err = float("nan") if err is None or real == 0 else err / 100
    bad = not abs(err) <= limit
    return f"{fmt(real)} / {fmt(sim)} ({err:+.0%}{' !' if bad else ''})", bad


def rows(name: str, real: dict, sim: dict, systems: list[str], mean_limit: float, p99_limit: float):
    out, bad, total = [], 0, 0
    for s in systems:
        if s not in real or s not in sim:
            continue
        cells = []
        for key, _ in METRICS:
            for stat, limit in (("mean", mean_limit), ("p99", p99_limit)):
                text, miss = cell(latency(real[s], key, stat), latency(sim[s], key, stat), limit)
                cells.append(text)
                bad, total = bad + miss, total + 1
        busy = f"{real[s]['resource_usage_s']:.0f} / {sim[s]['resource_usage_s']:.0f}"
        out.append(f"| {name} | {s} | " + " | ".join(cells) + f" | {busy} |")
        name = ""
    return out, bad, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pairs", nargs="+", help="REAL.json:SIM.json, one pair a workload")
    ap.add_argument("--systems", default="tetri,vllm,sarathi", help="systems to compare (comma-separated)")
    ap.add_argument("--mean-limit", type=float, default=0.10)
    ap.add_argument("--p99-limit", type=float, default=0.20)
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    head = " | ".join(f"{label} {stat} real / sim (err)" for _, label in METRICS for stat in ("mean", "P99"))
    print(f"| workload | system | {head} | busy s real / sim |")
    print("|---|---|" + "---|" * (2 * len(METRICS) + 1))
    bad = total = 0
    for pair in args.pairs:
        if ":" not in pair:
            ap.error(f"pair {pair!r}: expected REAL.json:SIM.json")
        real_path, sim_path = (Path(p) for p in pair.split(":", 1))
        try:
            real, sim = (json.loads(p.read_text())["systems"] for p in (real_path, sim_path))
        except (OSError, KeyError, json.JSONDecodeError) as e:
            ap.error(f"pair {pair!r}: cannot read a replay report ({e})")
        name = real_path.stem.removeprefix("run_")
        lines, b, t = rows(name, real, sim, systems, args.mean_limit, args.p99_limit)
        print("\n".join(lines))
        bad, total = bad + b, total + t
    print(f"\n{bad} of {total} cells over their limit (mean {args.mean_limit:.0%}, P99 {args.p99_limit:.0%}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
