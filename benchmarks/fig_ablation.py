#!/usr/bin/env python3
"""TetriInfer's Figures 16 and 18 at paper scale, explained by ablation (issue 58), on virtual time.

    benchmarks/fig_ablation.py run OUT [--only fig16|fig18] [--conditions ours,a,...]
    benchmarks/fig_ablation.py table OUT [--json results/fig_ablation.json]

``run`` starts from our setting (the commands of docs/notes/simulator.md, "Figure 16 at paper
scale" and "Figure 18 at paper scale": OPT-13B on simulated V100-32GBs, 1P+1D against vLLM on one
GPU; the decode policies on 1P+1D) and switches on one of the paper's conditions at a time, then
several together ('all': a + b + c + f; 'all-r1', 'all-r': the same at our rate; 'all-40g':
with 40 GiB; 'all-40g-4': with 40 GiB at 4 req/s):

    a  the baseline's scheduler as vLLM was then (v0.2: no prefix caching, a 2,048-token budget,
       256 sequences, 16-token blocks, recompute); Figure 18's decode instance the same
    b  arrivals: Poisson (as ours) at other rates, since the paper does not state its own: Figure
       16 at 0.25 (below saturation), 2 and 4 req/s; Figure 18 at 0.1 and 0.5 req/s
    c  lengths: ShareGPT requests that fit OPT-13B's 2,048-token context whole (the paper's model
       cannot serve more; ours clip 77-79 of 128 heavy prompts and 117 of Figure 18's 256)
    d  prediction accuracy: the paper's 74.9% is already ours; shown: the oracle, and what serve
       runs (sklearn's measured 65.7%)
    e  the link: RoCE is already ours (the paper's TS-RoCE); shown: NVLink
    f  KV per instance: the paper's card is ours (a V100-32GB keeps about 5,100 tokens of
       OPT-13B); shown: the same V100 with 80 GiB (about 61,700 tokens: what an A100-80GB or H100
       leaves OPT-13B) and with 40 GiB (about 14,500: an A100-40GB's), every step cost unchanged;
       no V100 has that memory

Every step is one ``aserve replay`` (in this process: no start-up per step) writing
OUT/<figure>/<condition>/<workload>.json; a step whose file exists is skipped, so a killed run
resumes. A condition that changes only one side reruns only that side; ``table`` takes the other
from ``ours``. ``table`` prints one table per figure and, with ``--json``, writes the result file
docs/RESULTS.md renders (scripts/results_page.py, kind ``ablation``).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" if (ROOT.parent / "shared" / "data").is_dir() else Path("/work/shared/data")
SHAREGPT = SHARED / "traces" / "sharegpt8k_lengths_llama2tok.csv"
PROFILE = ROOT / "aserve" / "profiles" / "sim_profiles" / "opt-13b-v100-32gb.json"
DEVICE = "sim:opt-13b-v100-32gb"
CONTEXT = 2048  # OPT-13B's
GIB = 2**30
KV_CARDS = {"f": 80 * GIB, "f-40g": 40 * GIB}  # condition f: a V100 with 80 GiB (an A100-80GB's or H100's memory), 40 GiB
FIG16_RATE, FIG18_RATE, FIG18_LOW_RATE = 0.25, 0.25, 0.1
WORKLOADS = ("LPLD", "LPHD", "HPLD", "HPHD", "Mixed")
POLICIES = ("greedy", "reserve-static", "reserve-dynamic")
ACC = ["--predictor", "accuracy", "--predictor-option", "accuracy=0.749"]
ORACLE = ["--predictor", "accuracy", "--predictor-option", "accuracy=1.0"]
VLLM_V0 = "--no-enable-prefix-caching --max-num-batched-tokens 2048 --max-num-seqs 256 --block-size 16 --preemption recompute"

# The paper's figures (§5.1 Figure 16: TS-RoCE against vLLM; §5.3 Figure 18: against greedy), as the notes quote them
PAPER16 = {"LPLD": {"ttft": -0.44, "jct": -0.40, "perf": 1.4}, "LPHD": {"ttft": -0.97, "jct": -0.47, "perf": 2.4},
           "HPLD": {"ttft": -0.09, "jct": -0.23, "perf": 0.86}, "HPHD": {"ttft": None, "jct": -0.19, "perf": 1.1},
           "Mixed": {"ttft": -0.85, "jct": -0.50, "perf": 1.9}}  # HPLD's perf/$ is read off the figure (≈)
PAPER18 = {"74.9%": {"reserve-static": None, "reserve-dynamic": 0.0},
           "100%": {"reserve-static": -0.10, "reserve-dynamic": -0.12}}

# What the two figures' conditions of the same letter change alike, said once
WHOLE = "lengths that fit OPT-13B's context whole (no clipped request)"
SERVED_PREDICTOR = "predictor: what serve runs (sklearn's measured 65.7%)"
KV_40G = "KV: a V100 with 40 GiB (about 14,500 tokens, 2.9x; no V100 has it)"
KV_80G = "KV: a V100 with 80 GiB (about 61,700 tokens, 12x; no V100 has it)"

# Figure 16: condition -> (what it switches on, which sides it reruns: both | ts | vllm; the other
# side comes from ``ours``)
CONDITIONS16 = {
    "ours": ("our setting: the committed traces (Poisson, 1 req/s), predictor at 74.9%, RoCE", "both"),
    "a": ("vLLM as then (v0.2): no prefix caching, 2,048-token budget, 256 seqs, 16-token blocks, recompute", "vllm"),
    "b": (f"arrivals at {FIG16_RATE:g} req/s (Poisson as ours; the paper's rate is not stated)", "both"),
    "b-2": ("arrivals at 2 req/s", "both"),
    "b-4": ("arrivals at 4 req/s", "both"),
    "c": (WHOLE, "both"),
    "d-oracle": ("predictor: the oracle (true bucket)", "ts"),
    "d-serve": (SERVED_PREDICTOR, "ts"),
    "e": ("link: NVLink (the paper's TS-NVLink)", "ts"),
    "f-40g": (KV_40G, "both"),
    "f": (KV_80G, "both"),
    "all": ("a + b + c + f (d and e as ours: 74.9%, RoCE)", "both"),
    "all-r1": ("a + c + f at our 1 req/s (all but b)", "both"),
    "all-40g": ("a + c + f at 40 GiB, at our 1 req/s", "both"),
    "all-40g-4": ("a + c + f at 40 GiB, at 4 req/s", "both"),
}
# Figure 18: condition -> what it switches on (every condition reruns all three policies)
CONDITIONS18 = {
    "ours": f"our setting: ShareGPT lengths clipped to 2,048, Poisson at {FIG18_RATE:g} req/s, predictor at 74.9%, RoCE",
    "a": "decode instance as vLLM then: no prefix caching, 256 seqs, 16-token blocks, recompute",
    "b": f"arrivals at {FIG18_LOW_RATE:g} req/s (below saturation; the paper's rate is not stated)",
    "b-0.5": "arrivals at 0.5 req/s",
    "c": WHOLE,
    "d-oracle": "predictor: the oracle (the paper's 100% column)",
    "d-serve": SERVED_PREDICTOR,
    "e": "link: NVLink",
    "f-40g": KV_40G,
    "f-40g-oracle": "f at 40 GiB with the oracle",
    "f": KV_80G,
    "all": "a + b + c + f at 74.9% (the paper's 74.9% column)",
    "all-oracle": "a + b + c + f with the oracle (the paper's 100% column)",
    "all-r": f"a + c + f at our {FIG18_RATE:g} req/s (all but b), 74.9%",
    "all-r-oracle": f"a + c + f at our {FIG18_RATE:g} req/s (all but b), the oracle",
    "all-40g": f"a + c + f at 40 GiB, at our {FIG18_RATE:g} req/s, 74.9%",
    "all-40g-oracle": f"a + c + f at 40 GiB, at our {FIG18_RATE:g} req/s, the oracle",
}


# ---- the grid ----------------------------------------------------------------------------------

def fit_lengths(out: Path) -> Path:
    """The ShareGPT length table cut to the requests whose prompt + output fit OPT-13B's context."""
    path = out / "sharegpt_fit2048.csv"
    if not path.exists():
        with open(SHAREGPT) as f, open(path.with_suffix(".tmp"), "w", newline="") as g:
            r = csv.DictReader(f)
            w = csv.DictWriter(g, fieldnames=r.fieldnames)
            w.writeheader()
            w.writerows(row for row in r if int(row["num_total_tokens"]) <= CONTEXT)
        path.with_suffix(".tmp").rename(path)
    return path


def big_kv_profile(out: Path, memory_bytes: int) -> Path:
    """The V100-32GB profile with ``memory_bytes`` of memory: a larger KV pool, every step cost
    unchanged (a card that does not exist)."""
    name = f"opt-13b-v100-{memory_bytes // GIB}gib"
    path = out / f"{name}.json"
    if not path.exists():
        data = json.loads(PROFILE.read_text())
        data["hardware"]["memory_bytes"] = memory_bytes
        data["name"] = name
        data["about"] = (f"{name}: the V100-32GB profile (OPT-13B) with {memory_bytes // GIB} GiB of memory, so a larger "
                         "KV pool and the same step costs: issue 58's ablation, a card that does not exist")
        path.write_text(json.dumps(data, indent=1))
    return path


def not_a_v100(cond: str) -> bool:
    """Does the condition run on a V100 with more memory than any V100 has (f and every 'all')?"""
    return "40g" in cond or cond == "f" or cond.startswith("all")


def device_for(out: Path, cond: str) -> str:
    """The simulated device of a condition: the V100-32GB, or (f and every 'all') a V100 with more memory."""
    if not not_a_v100(cond):
        return DEVICE
    return f"sim:{big_kv_profile(out, KV_CARDS['f-40g' if '40g' in cond else 'f'])}"


def fig16_steps(out: Path) -> list[tuple[str, str, list[str]]]:
    """(condition, workload, argv) for every Figure 16 replay."""
    ts = "--mode disagg --prefill 1 --decode 1 --link roce"
    vllm = "--mode coupled --instances 1 --batching vllm"
    steps = []
    for cond, (_, sides) in CONDITIONS16.items():
        for w in WORKLOADS:
            trace = str(ROOT / "traces" / f"{w}.jsonl")
            extra, predictor, t, v = [], ACC, ts, vllm
            if cond == "a" or cond.startswith("all"):
                v = f"{vllm} {VLLM_V0}"
            if cond in ("b", "all"):
                extra += ["--rate", str(FIG16_RATE)]
            if cond.startswith("b-") or cond == "all-40g-4":
                extra += ["--rate", cond.rsplit("-", 1)[1]]
            if cond == "c" or cond.startswith("all"):
                trace = str(out / "traces" / f"{w}.jsonl")
            if cond == "d-oracle":
                predictor = ORACLE
            if cond == "d-serve":
                predictor = []
            if cond == "e":
                t = ts.replace("roce", "nvlink")
            device = device_for(out, cond)
            systems = {"both": [("ts-roce", t), ("vllm-1gpu", v)], "ts": [("ts-roce", t)], "vllm": [("vllm-1gpu", v)]}[sides]
            steps.append((cond, w, [trace, "--device", device, *predictor, *extra,
                                    "--compare", " ; ".join(f"{n}: {f}" for n, f in systems)]))
    return steps


def fig18_steps(out: Path) -> list[tuple[str, str, list[str]]]:
    steps = []
    for cond in CONDITIONS18:
        trace, rate, predictor, link, flags = str(SHAREGPT), FIG18_RATE, ACC, "roce", ""
        if cond in ("a",) or cond.startswith("all"):
            flags = " --no-enable-prefix-caching --max-num-seqs 256 --block-size 16 --preemption recompute"
        if cond in ("b", "all", "all-oracle"):
            rate = FIG18_LOW_RATE
        if cond.startswith("b-"):
            rate = float(cond.removeprefix("b-"))
        if cond in ("c",) or cond.startswith("all"):
            trace = str(fit_lengths(out))
        if cond == "d-oracle" or cond.endswith("-oracle"):
            predictor = ORACLE
        if cond == "d-serve":
            predictor = []
        if cond == "e":
            link = "nvlink"
        device = device_for(out, cond)
        compare = " ; ".join(f"{p}: --mode disagg --prefill 1 --decode 1 --link {link} --decode-policy {p}{flags}"
                             for p in POLICIES)
        steps.append((cond, "ShareGPT", [trace, "--num-requests", "256", "--rate", str(rate), "--device", device,
                                         *predictor, "--compare", compare]))
    return steps


def make_fit_traces(out: Path) -> None:
    """Condition c's Figure 16 traces: `aserve workload` over the lengths that fit, as committed otherwise."""
    from aserve.commands import main as aserve

    lengths = fit_lengths(out)
    for w in WORKLOADS:
        path = out / "traces" / f"{w}.jsonl"
        if not path.exists():
            with contextlib.redirect_stdout(io.StringIO()):
                aserve(["workload", w, "--num-requests", "128", "--rate", "1.0", "--seed", "0",
                        "--lengths", str(lengths), "--out", str(path)])


def run(a: argparse.Namespace) -> int:
    from aserve.commands import main as aserve

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps = []
    if a.only in (None, "fig16"):
        make_fit_traces(out)
        steps += [("fig16", c, w, argv) for c, w, argv in fig16_steps(out)]
    if a.only in (None, "fig18"):
        steps += [("fig18", c, w, argv) for c, w, argv in fig18_steps(out)]
    if a.conditions:  # a slice (benchmarks/sim_check.py reruns 'ours')
        known = set(CONDITIONS16) | set(CONDITIONS18)
        wanted = a.conditions.split(",")
        if set(wanted) - known:
            raise SystemExit(f"--conditions: unknown {', '.join(sorted(set(wanted) - known))} "
                             f"(known: {', '.join(sorted(known))})")
        steps = [st for st in steps if st[1] in wanted]
    commits = out / "commits.txt"  # every commit a step of this OUT ran at (a resumed run may add one)
    head = _commit()
    if head and head not in (commits.read_text().split() if commits.exists() else []):
        with open(commits, "a") as f:
            f.write(head + "\n")
    t_all = time.monotonic()
    for i, (fig, cond, w, argv) in enumerate(steps, 1):
        path = out / fig / cond / f"{w}.json"
        if path.exists():
            print(f"[{i}/{len(steps)}] {fig} {cond} {w}: done before, skipped", flush=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial.json")
        full = ["replay", *argv, "--no-progress", "--json", str(tmp)]
        (path.with_suffix(".cmd")).write_text("aserve " + " ".join(map(_quote, full)).replace(str(tmp), str(path)) + "\n")
        t0 = time.monotonic()
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            rc = aserve(full)
        path.with_suffix(".txt").write_text(log.getvalue())
        if not tmp.exists():
            raise SystemExit(f"{fig} {cond} {w}: the replay wrote no report (rc {rc}); its output is in "
                             f"{path.with_suffix('.txt')}")
        tmp.rename(path)
        path.with_suffix(".wall").write_text(f"{time.monotonic() - t0:.1f}\n")
        print(f"[{i}/{len(steps)}] {fig} {cond} {w}: {time.monotonic() - t0:.1f} s (rc {rc}; "
              f"{time.monotonic() - t_all:.0f} s so far)", flush=True)
    print(f"all {len(steps)} steps in {out} ({time.monotonic() - t_all:.0f} s this run)")
    return 0


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


# ---- the tables (pure: the reports in, figures out) ----------------------------------------------

def _load(out: Path, fig: str, cond: str, w: str):
    path = out / fig / cond / f"{w}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _gain(base: float, new: float) -> float:
    return new / base - 1.0


def fig16_data(out: Path) -> dict:
    """Per condition and workload: TS-RoCE against vLLM on one GPU (TTFT, JCT, perf/$), with each
    side's mean TTFT, JCT and makespan; a side the condition does not change comes from ``ours``;
    a cell whose report is missing is None."""
    rows = {}
    for cond, (what, sides) in CONDITIONS16.items():
        cells = {}
        for w in WORKLOADS:
            mine, ours = _load(out, "fig16", cond, w), _load(out, "fig16", "ours", w)
            pick = {}
            for name, side in (("ts-roce", "ts"), ("vllm-1gpu", "vllm")):
                src = mine if sides in ("both", side) else ours
                pick[name] = (src or {}).get("systems", {}).get(name)
            ts, vl = pick["ts-roce"], pick["vllm-1gpu"]
            if ts is None or vl is None:
                cells[w] = None
                continue
            perf = lambda s: s["output_tokens_per_s"] / s["resource_usage_s"]  # noqa: E731
            cells[w] = {"ttft": _gain(vl["ttft"]["mean"], ts["ttft"]["mean"]),
                        "jct": _gain(vl["jct"]["mean"], ts["jct"]["mean"]),
                        "perf": perf(ts) / perf(vl),
                        "ts_jct_s": ts["jct"]["mean"], "vllm_jct_s": vl["jct"]["mean"],
                        "ts_ttft_s": ts["ttft"]["mean"], "vllm_ttft_s": vl["ttft"]["mean"],
                        "vllm_makespan_s": vl["makespan_s"], "ts_preemptions": ts.get("preemptions", 0),
                        "vllm_preemptions": vl.get("preemptions", 0),
                        "clipped": ((mine or ours) or {}).get("trace", {}).get("num_clipped", 0)}
        rows[cond] = {"what": what, "cells": cells, "not_a_v100": not_a_v100(cond)}
    return rows


def fig18_data(out: Path) -> dict:
    """Per condition: each policy's mean JCT, preemptions and makespan, and each reservation policy
    against greedy; a missing report is None."""
    rows = {}
    for cond, what in CONDITIONS18.items():
        rep = _load(out, "fig18", cond, "ShareGPT")
        cell = None
        if rep is not None:
            s = rep["systems"]
            cell = {p: {"jct_s": s[p]["jct"]["mean"], "ttft_s": s[p]["ttft"]["mean"], "preemptions": s[p].get("preemptions", 0),
                        "makespan_s": s[p]["makespan_s"]} for p in POLICIES}
            for p in POLICIES[1:]:
                cell[p]["vs_greedy"] = _gain(cell["greedy"]["jct_s"], cell[p]["jct_s"])
            cell["clipped"] = rep.get("trace", {}).get("num_clipped", 0)
        rows[cond] = {"what": what, "cell": cell, "not_a_v100": not_a_v100(cond)}
    return rows


def _p(x) -> str:
    return "n/g" if x is None else "0%" if abs(x) < 0.005 else f"{x * 100:+.0f}%"


def fig16_table(d: dict) -> str:
    head = "| condition | " + " | ".join(f"{w}: TTFT / JCT / perf/$" for w in WORKLOADS) + " |"
    lines = [head, "|---|" + "---|" * len(WORKLOADS)]
    lines.append("| **paper** | " + " | ".join(f"{_p(PAPER16[w]['ttft'])} / {_p(PAPER16[w]['jct'])} / {PAPER16[w]['perf']:.2f}x"
                                             for w in WORKLOADS) + " |")
    for cond, row in d.items():
        cells = [("missing" if c is None else f"{_p(c['ttft'])} / **{_p(c['jct'])}** / {c['perf']:.2f}x")
                 for c in (row["cells"][w] for w in WORKLOADS)]
        lines.append(f"| {cond}: {row['what']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fig18_table(d: dict) -> str:
    lines = ["| condition | greedy JCT s (preemptions) | reserve-static vs greedy | reserve-dynamic vs greedy | makespan s (greedy) | clipped |",
             "|---|---|---|---|---|---|",
             "| **paper** (74.9% / 100%) | | n/g / **-10%** | **+0%** / **-12%** | | |"]
    for cond, row in d.items():
        c = row["cell"]
        if c is None:
            lines.append(f"| {cond}: {row['what']} | missing | | | | |")
            continue
        lines.append(f"| {cond}: {row['what']} | {c['greedy']['jct_s']:.1f} ({c['greedy']['preemptions']}) "
                     f"| {_p(c['reserve-static']['vs_greedy'])} ({c['reserve-static']['preemptions']}) "
                     f"| **{_p(c['reserve-dynamic']['vs_greedy'])}** ({c['reserve-dynamic']['preemptions']}) "
                     f"| {c['greedy']['makespan_s']:.0f} | {c['clipped']} |")
    return "\n".join(lines)


def build(out: Path) -> dict:
    """Both figures' data from OUT (pure: reads the reports only)."""
    d16, d18 = fig16_data(out), fig18_data(out)
    missing = ([f"fig16 {c} {w}" for c, r in d16.items() for w, v in r["cells"].items() if v is None]
               + [f"fig18 {c}" for c, r in d18.items() if r["cell"] is None])
    walls = [float(p.read_text()) for p in sorted(out.glob("fig*/*/*.wall"))]
    return {"fig16": d16, "fig18": d18, "paper16": PAPER16, "paper18": PAPER18, "missing": missing,
            "workloads": list(WORKLOADS), "policies": list(POLICIES),
            "wall_s": round(sum(walls), 1), "replays": len(walls)}


def table(a: argparse.Namespace) -> int:
    out = Path(a.out)
    data = build(out)
    print("Figure 16: TS-RoCE (1P+1D) against vLLM on one GPU, mean TTFT / mean JCT / perf/$\n")
    print(fig16_table(data["fig16"]))
    print("\nFigure 18: each reservation policy's mean JCT against greedy (1P+1D), preemptions in brackets\n")
    print(fig18_table(data["fig18"]))
    if data["missing"]:
        print(f"\nmissing ({len(data['missing'])}): {', '.join(data['missing'])}")
    if a.json:
        prev = json.loads(Path(a.json).read_text()) if Path(a.json).exists() else {}
        meta = {**_meta(out), **{k: v for k, v in prev.get("meta", {}).items() if k in ("question", "title", "order", "kind")}}
        if a.keep_meta and prev.get("meta"):
            meta = prev["meta"]
        else:
            meta["wall_time"] = (f"{data['wall_s'] / 60:.0f} min for {data['replays']} replays on virtual time, in one "
                                 "process (the steps' own seconds; a resumed run counts each step once)")
        Path(a.json).write_text(json.dumps({"meta": meta, "data": data}, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


def _commit() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def _meta(out: Path) -> dict:
    commits = out / "commits.txt"
    commit = ", ".join(commits.read_text().split()) if commits.exists() else _commit()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.machine()) if Path("/proc/cpuinfo").exists() else platform.machine()
    return {"order": 55, "kind": "ablation", "title": "Figures 16 and 18 at paper scale, explained by ablation (simulated)",
            "question": "Which of the TetriInfer paper's conditions produce its Figure 16 and 18 gains on simulated "
                        "V100s with OPT-13B, switched on one at a time from our setting?",
            "machine": f"{model}, {os.cpu_count()} cores (virtual time: the figures do not depend on it)",
            "commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "command": "benchmarks/fig_ablation.py run OUT && benchmarks/fig_ablation.py table OUT --json results/fig_ablation.json",
            "wall_time": "", "notes": "docs/notes/simulator.md",
            "source": "Figures 16 and 18 at paper scale explained by ablation (issue 58), 2026-11-29"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run every replay of the grid (resumable)")
    r.add_argument("out")
    r.add_argument("--only", choices=("fig16", "fig18"), default=None)
    r.add_argument("--conditions", default=None, help="comma-separated: run only these conditions' replays")
    r.set_defaults(func=run)
    t = sub.add_parser("table", help="print the tables; --json writes the result file")
    t.add_argument("out")
    t.add_argument("--json", default=None)
    t.add_argument("--keep-meta", action="store_true", help="keep the result file's meta block as it is")
    t.set_defaults(func=table)
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
