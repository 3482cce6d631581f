#!/usr/bin/env python3
"""TetriInfer's Figure 16 from `aserve replay --json` reports on a simulated device, beside the paper.

    benchmarks/fig16_table.py DIR

DIR holds one report per workload, `fig16_{LPLD,LPHD,HPLD,HPHD,Mixed}.json`, each with the
systems `ts-roce`, `ts-nvlink`, `vllm-1gpu`, `vllm-2gpu`, `sarathi-2gpu` (the commands are in
docs/notes/simulator.md, "Figure 16 at paper scale"). Prints one markdown table: every system's mean
TTFT, mean JCT, busy seconds (the paper's resource usage), perf/$ against vLLM on one GPU, P99
token gap and preemptions, then TS-RoCE against vLLM on one GPU beside the paper's §5.1 figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # side_by_side.py, a tool
from side_by_side import pct_diff  # noqa: E402

WORKLOADS = ("LPLD", "LPHD", "HPLD", "HPHD", "Mixed")
SYSTEMS = ("ts-roce", "ts-nvlink", "vllm-1gpu", "vllm-2gpu", "sarathi-2gpu")
# §5.1 and Figure 16, TetriInfer (TS-RoCE) against vLLM: TTFT, JCT, perf/$ ("n/g": not given)
PAPER = {"LPLD": "-44% / -40% / 1.4x", "LPHD": "-97% / -47% / 2.4x", "HPLD": "-9% / -23% / ≈0.86x",
         "HPHD": "n/g / -19% / 1.1x", "Mixed": "-85% / -50% / 1.9x"}


def perf(s: dict) -> float:
    """Output tokens per second per busy second (the paper's perf/$ before normalising)."""
    return s["output_tokens_per_s"] / s["resource_usage_s"]


def rows(workload: str, report: dict) -> list[str]:
    systems = report["systems"]
    missing = [name for name in SYSTEMS if name not in systems]
    if missing:
        raise SystemExit(f"{workload}: the report has no {', '.join(missing)} (systems: {', '.join(systems)})")
    base, ts = systems["vllm-1gpu"], systems["ts-roce"]
    pct = lambda key: f"{pct_diff(base[key]['mean'], ts[key]['mean']):+.0f}%"  # noqa: E731
    versus = (f"{pct('ttft')} / {pct('jct')}"
              f" / {perf(ts) / perf(base):.2f}x")
    out = []
    for i, name in enumerate(SYSTEMS):
        s = systems[name]
        first = (f"| {workload} | {report['trace'].get('num_clipped', 0)} " if i == 0 else "|  |  ")
        tail = f"| {versus} | {PAPER[workload]} |" if i == 0 else "|  |  |"
        out.append(f"{first}| {name} | {s['ttft']['mean']:.2f} | {s['jct']['mean']:.2f} | {s['resource_usage_s']:.0f} "
                   f"| {perf(s) / perf(base):.2f} | {s['token_gap']['p99']:.3f} | {s.get('preemptions', 0)} "
                   f"| {s['makespan_s']:.0f} {tail}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="folder with fig16_<workload>.json")
    args = ap.parse_args()
    print("| workload | clipped | system | mean TTFT s | mean JCT s | busy s | perf/$ vs vllm-1gpu "
          "| P99 token gap s | preemptions | makespan s | TS-RoCE vs vllm-1gpu: TTFT / JCT / perf/$ | paper |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for w in WORKLOADS:
        path = os.path.join(args.dir, f"fig16_{w}.json")
        if not os.path.exists(path):
            raise SystemExit(f"no report for {w}: {path} is missing")
        with open(path) as f:
            for line in rows(w, json.load(f)):
                print(line)


if __name__ == "__main__":
    main()
