#!/usr/bin/env python3
"""Issue 24's check: adaptive against the better coupled baseline, per workload, from replay JSONs.

    scripts/adaptive_table.py W1.json [W2.json ...] [--adaptive adaptive] [--tie 0.03]

Each JSON is one `aserve replay --compare` report (or several merged by name: every file is read
and its systems pooled under the file's stem). Prints one markdown row per system and workload
(mean TTFT, mean JCT, P99 token gap, busy s, perf/$ as the paper defines it: output tokens/s per
summed busy second, and per provisioned instance-second: output tokens / (makespan x instances))
and, for the adaptive system, each criterion: TTFT and JCT no worse than the better of vllm and
sarathi (within --tie counts as a tie, marked '='), P99 gap no worse than sarathi's, both perf/$
no worse than the better baseline's.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BASELINES = ("vllm", "sarathi")


def figures(s: dict) -> dict:
    busy = s["resource_usage_s"] or float("nan")
    out_s = s["output_tokens_per_s"]
    instances = max(1, len(s.get("instances") or []))
    return {"ttft": s["ttft"]["mean"], "jct": s["jct"]["mean"], "gap99": s["token_gap"]["p99"], "busy": busy,
            "perf": out_s / busy, "perf_core": s["output_tokens"] / (s["makespan_s"] * instances),
            "flips": s.get("flips") or 0, "makespan": s["makespan_s"], "ok": s["completed"],
            "n": s["completed"] + s["failed"] + s["aborted"]}


def verdict(value: float, best: float, tie: float, higher_better: bool = False) -> str:
    """ok: no worse than ``best``; '=': worse by at most ``tie`` (a tie); else WORSE."""
    if higher_better:
        worse, close = value < best, value >= best * (1 - tie)
    else:
        worse, close = value > best, value <= best * (1 + tie)
    return "ok" if not worse else "=" if close else "WORSE"


def rows(name: str, systems: dict, adaptive: str, tie: float) -> list[str]:
    figs = {k: figures(v) for k, v in systems.items()}
    out = []
    for sys_name, f in figs.items():
        checks = ""
        if sys_name == adaptive and all(b in figs for b in BASELINES):
            b = [figs[x] for x in BASELINES]
            checks = " / ".join((
                verdict(f["ttft"], min(x["ttft"] for x in b), tie), verdict(f["jct"], min(x["jct"] for x in b), tie),
                verdict(f["gap99"], figs["sarathi"]["gap99"], tie),
                verdict(f["perf"], max(x["perf"] for x in b), tie, True),
                verdict(f["perf_core"], max(x["perf_core"] for x in b), tie, True)))
        out.append(f"| {name} | {sys_name} | {f['ttft']:.3f} | {f['jct']:.2f} | {f['gap99']:.3f} | {f['busy']:.0f} | "
                   f"{f['perf']:.3f} | {f['perf_core']:.2f} | {f['flips']} | {f['ok']}/{f['n']} | {checks} |")
        name = ""
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--adaptive", default="adaptive", help="the adaptive system's name in the reports")
    p.add_argument("--tie", type=float, default=0.03, help="a relative difference counted as a tie")
    a = p.parse_args(argv)
    print("| workload | system | mean TTFT s | mean JCT s | P99 token gap s | busy s | perf/$ (tok/s per busy s) | "
          "tok per instance-s | flips | done | adaptive: TTFT / JCT / P99 gap / perf/$ / per instance-s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    pooled: dict[str, dict] = {}
    for path in a.files:
        stem = Path(path).stem.split("_")[-1]
        pooled.setdefault(stem, {}).update(json.loads(Path(path).read_text())["systems"])
    for name, systems in pooled.items():
        print("\n".join(rows(name, systems, a.adaptive, a.tie)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
