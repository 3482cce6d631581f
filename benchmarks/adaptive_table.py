#!/usr/bin/env python3
"""Issue 24's check: adaptive against the better coupled baseline, per workload, from replay JSONs.

    benchmarks/adaptive_table.py [LABEL=]W1.json [[LABEL=]W2.json ...] [--mean] [--adaptive adaptive] [--tie 0.03]

Each JSON is one `aserve replay --compare` report, filed under LABEL (default: the file name's last
'_' part, so run_LPLD.json is LPLD). Reports under one label are pooled: a system in a later file
replaces the earlier one's, or, with --mean, each figure is the mean over every run of that system
under the label (done counts are summed): the table of several runs of a workload, for example one
per arrival stretch, where one run is one draw. Prints one markdown row per system and workload
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
# issue 24's criteria: (label, figure, compared with: "best" of BASELINES or one system, lower is better)
CRITERIA = (("mean TTFT", "ttft", "best", True), ("mean JCT", "jct", "best", True),
            ("P99 token gap", "gap99", "sarathi", True), ("perf/$ (busy)", "perf", "best", False),
            ("per instance-s", "perf_core", "best", False))


def figures(s: dict) -> dict:
    busy = s["resource_usage_s"] or float("nan")
    out_s = s["output_tokens_per_s"]
    instances = max(1, len(s.get("instances") or []))
    return {"ttft": s["ttft"]["mean"], "jct": s["jct"]["mean"], "gap99": s["token_gap"]["p99"], "busy": busy,
            "perf": out_s / busy, "perf_core": s["output_tokens"] / (s["makespan_s"] * instances),
            "flips": s.get("flips") or 0, "makespan": s["makespan_s"], "ok": s["completed"],
            "n": s["completed"] + s["failed"] + s["aborted"]}


def verdict(value: float, best: float, tie: float, higher_better: bool = False) -> str:
    """ok: no worse than ``best``; '=': worse by at most ``tie`` (a tie); else WORSE; then the difference."""
    if higher_better:
        worse, close = value < best, value >= best * (1 - tie)
    else:
        worse, close = value > best, value <= best * (1 + tie)
    mark = "ok" if not worse else "=" if close else "WORSE"
    if not best:
        return mark
    return f"{mark} ({round(100 * (value / best - 1), 1) + 0.0:+.1f}%)"  # + 0.0: no "-0.0%"


def mean_figures(runs: list[dict]) -> dict:
    """Several runs' figures as one: each figure's mean, completions and flips summed, ``runs`` counted."""
    out = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    out.update({k: sum(r[k] for r in runs) for k in ("flips", "ok", "n")}, runs=len(runs))
    return out


def rows(name: str, figs: dict[str, dict], adaptive: str, tie: float) -> list[str]:
    out = []
    for sys_name, f in figs.items():
        checks = ""
        if sys_name == adaptive and all(b in figs for b in BASELINES):
            marks = []
            for _, key, ref, lower in CRITERIA:
                pick = min if lower else max
                other = figs[ref][key] if ref != "best" else pick(figs[b][key] for b in BASELINES)
                marks.append(verdict(f[key], other, tie, not lower))
            checks = " / ".join(marks)
        label = f"{sys_name} (mean of {f['runs']})" if f.get("runs", 1) > 1 else sys_name
        out.append(f"| {name} | {label} | {f['ttft']:.3f} | {f['jct']:.2f} | {f['gap99']:.3f} | {f['busy']:.0f} | "
                   f"{f['perf']:.3f} | {f['perf_core']:.2f} | {f['flips']} | {f['ok']}/{f['n']} | {checks} |")
        name = ""
    return out


def pooled(files: list[str], mean: bool) -> dict[str, dict[str, dict]]:
    """{label: {system: figures}} from ``[LABEL=]path`` arguments (see the module docstring)."""
    runs: dict[str, dict[str, list[dict]]] = {}
    for arg in files:
        label, sep, path = arg.partition("=")
        if not sep or Path(arg).exists():
            label, path = Path(arg).stem.split("_")[-1], arg
        try:
            systems = json.loads(Path(path).read_text())["systems"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"adaptive_table: {path} is not a replay report ({e})") from None
        for sys_name, report in systems.items():
            runs.setdefault(label, {}).setdefault(sys_name, []).append(figures(report))
    return {label: {s: mean_figures(r) if mean else r[-1] for s, r in systems.items()}
            for label, systems in runs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", metavar="[LABEL=]REPORT.json")
    p.add_argument("--mean", action="store_true",
                   help="average each system over the reports under one label instead of keeping the last")
    p.add_argument("--adaptive", default="adaptive", help="the adaptive system's name in the reports")
    p.add_argument("--tie", type=float, default=0.03, help="a relative difference counted as a tie")
    a = p.parse_args(argv)
    print("| workload | system | mean TTFT s | mean JCT s | P99 token gap s | busy s | perf/$ (tok/s per busy s) | "
          "tok per instance-s | flips | done | adaptive: TTFT / JCT / P99 gap / perf/$ / per instance-s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, figs in pooled(a.files, a.mean).items():
        print("\n".join(rows(name, figs, a.adaptive, a.tie)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
