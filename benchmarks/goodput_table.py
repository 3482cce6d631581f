#!/usr/bin/env python3
"""Issue 54's goodput tables from ``benchmarks/goodput_paper.sh OUT_DIR``'s runs (paper scale) or
``benchmarks/goodput_cpu.sh OUT_DIR``'s (``--cpu``: this machine's CPU, two instances).

    python benchmarks/goodput_table.py OUT_DIR [--json results/goodput_paper.json] [--plots docs/plots]
    python benchmarks/goodput_table.py OUT_DIR --cpu [--json results/goodput_cpu.json] [--plots docs/plots]
    python benchmarks/goodput_table.py OUT_DIR --overlay OUT2 ...   # OUT2's systems replace OUT_DIR's

``--overlay`` reads a later run of some systems (``SYSTEMS=vllm,sarathi benchmarks/goodput_paper.sh
OUT2``, after a change that touched only them): each of its systems replaces the same system in
the same cell, and its commit and date join the result's.

Prints one markdown table (workload x corner rows; vllm, sarathi, tetri at its best static split,
adaptive: goodput per device, req/s, with the knee's error bar), the Azure code trace's rows beside
it (report-only), and writes the small result file (every cell, the attainment curves of Mixed
and Azure, each run's command, commit, date and machine) and the curves' plots.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

CORNERS = ("balanced", "tight-ttft", "tight-tpot")
WORKLOADS = ("LPLD", "LPHD", "HPLD", "HPHD", "Mixed", "Azure")
REPORT_ONLY = ("AzureCode",)
COLUMNS = ("vllm", "sarathi", "tetri", "adaptive")
TETRI = ("tetri-1p3d", "tetri-2p2d", "tetri-3p1d")
CURVES = ("Mixed", "Azure")


@dataclass(frozen=True)
class Layout:
    """What one table's runs are: the device, how many a system runs on, the static splits searched."""

    device: str
    devices: int
    splits: tuple
    script: str
    order: int
    title: str
    question: str
    source: str


PAPER = Layout("sim:opt-13b-v100-32gb", 4, TETRI, "benchmarks/goodput_paper.sh", 30,
               "Goodput under SLOs at paper scale",
               "At which arrival rate does each design still serve 90% of requests within every SLO "
               "(four V100s, OPT-13B, simulated), on each workload and SLO corner?",
               "Paper scale: four V100s, every workload and corner")
CPU = Layout("cpu", 2, ("tetri",), "benchmarks/goodput_cpu.sh", 31,
             "Goodput under SLOs on this CPU",
             "The same question on the real device: two instances of one thread each on this machine's CPU, "
             "SmolLM2-135M, the traces shrunk to fit a session?",
             "The real CPU rows")


def best_tetri(systems: dict) -> tuple[str, dict]:
    """The static split with the highest goodput (a split that passed nowhere ranks last); on two
    devices the only split, ``tetri`` (1P+1D)."""
    ranked = sorted(((s["goodput_per_device"] or -1.0, name) for name, s in systems.items()
                     if name in TETRI or name == "tetri"), reverse=True)
    return ranked[0][1], systems[ranked[0][1]]


def split_of(name: str, s: dict) -> str:
    """``tetri-2p2d`` -> 2P+2D; a plain ``tetri`` reads its split from its config."""
    if "-" in name:
        code = name.split("-")[1]
        return f"{code[0]}P+{code[2]}D"
    return s["config"]["layout"]


def cell(name: str, s: dict, split: str = "") -> dict:
    out = {"system": name, "split": split or None, "goodput_per_device": s["goodput_per_device"],
           "knee_rate": s["knee_rate"], "knee_bracket": s["knee_bracket"], "bound": s["bound"],
           "limited_by": s["limited_by"], "num_points": s["num_points"], "wall_s": round(s["wall_s"], 1),
           "predictor": s["predictor"], "monotone": s["monotone"], "devices": s["devices"]}
    if s.get("estimated_knee_rate") is not None:  # a real search's simulated twin (sim:local): where it started
        out["simulated_knee_rate"] = s["estimated_knee_rate"]
    return out


def simulated_knees(log: Path) -> dict:
    """``{system: knee rate}`` from a real search's log ("NAME: estimated wall time ... knee near R req/s"),
    for runs made before the JSON carried ``estimated_knee_rate``."""
    import re

    out = {}
    if log.exists():
        for m in re.finditer(r"^(\S+): estimated wall time .*knee near ([0-9.e+-]+) req/s", log.read_text(), re.M):
            out[m.group(1)] = float(m.group(2))
    return out


def row_cells(run: dict) -> dict:
    systems = run["systems"]
    out = {name: cell(name, systems[name]) for name in ("vllm", "sarathi", "adaptive") if name in systems}
    if any(n in TETRI or n == "tetri" for n in systems):
        split, s = best_tetri(systems)
        out["tetri"] = cell("tetri", s, split_of(split, s))
        out["tetri"]["splits"] = {n: systems[n]["goodput_per_device"] for n in TETRI if n in systems}
    return out


def curves_of(run: dict) -> dict:
    """A run's attainment curve per system: its points as [rate, attainment]."""
    return {n: s["points"] for n, s in run["systems"].items()}


def merge_into(path: Path, runs: dict, abouts: set, how: str) -> dict:
    """The result file at ``path`` with this run's systems in place of its own, cell by cell (a
    system this run has replaces that system's cell and curve; every other cell stays), and the
    run's commit, date and machine added to its meta: a later search of some systems (SYSTEMS=adaptive
    ... after a change to adaptive) updates the committed table without the earlier runs' folders."""
    result = json.loads(path.read_text())
    data, meta = result["data"], result["meta"]
    for (w, c), run in runs.items():
        for name, new in row_cells(run).items():
            at = [i for i, x in enumerate(data["cells"]) if (x["workload"], x["corner"], x["system"]) == (w, c, name)]
            if not at:
                raise SystemExit(f"{path} has no {w} {c} {name} cell to replace")
            data["cells"][at[0]] = {"workload": w, "corner": c, **new}
        if w in data.get("curves", {}):
            data["curves"][w].setdefault(c, {}).update(curves_of(run))
    for key, i in (("commit", 0), ("date", 1), ("machine", 2)):
        sep = "; " if key == "machine" else ", "
        meta[key] = sep.join(sorted(set(meta[key].split(sep)) | {a[i] for a in abouts}))
    meta["command"] += f" && {how}"
    searches = [s for r in runs.values() for s in r["systems"].values()]
    meta["wall_time"] += f"; then {sum(s['wall_s'] for s in searches) / 60:.0f} min ({len(searches)} searches merged)"
    return result


def text(c: dict, best: bool) -> str:
    g, (lo, hi) = c["goodput_per_device"], c["knee_bracket"]
    if c["bound"] == "below":
        t = "0 (none)"
    elif g is None:
        t = "n/a"
    else:
        err = f" (+{(hi - lo) / c['devices']:.2g})" if hi is not None and lo is not None else ""  # the bracket, per device
        t = (">= " if c["bound"] == "at_least" else "") + f"{g:.3g}{err}"
    t += f" ({c['split']})" if c.get("split") else ""
    return f"**{t}**" if best else t


def markdown(rows: dict, title: str) -> str:
    lines = [f"| {title} | corner | " + " | ".join(COLUMNS) + " | limited by (best) |",
             "|---|---|" + "---:|" * len(COLUMNS) + "---|"]
    for (w, corner), cells in rows.items():
        top = max((c["goodput_per_device"] or 0.0) for c in cells.values())
        best = max(cells.values(), key=lambda c: c["goodput_per_device"] or 0.0)
        lines.append(f"| {w} | {corner} | " + " | ".join(
            text(cells[n], top > 0 and (cells[n]["goodput_per_device"] or 0) >= top * 0.999) if n in cells else "-"
            for n in COLUMNS)
            + f" | {best['limited_by'] or '-'} |")
    return "\n".join(lines)


def wall_times(runs: dict) -> str:
    """How long one system's search took (wall seconds on this machine), per workload."""
    import statistics

    lines = ["| workload | searches | wall s per system's search: median | max | points: median | max |",
             "|---|---:|---:|---:|---:|---:|"]
    for w in WORKLOADS + REPORT_ONLY:
        s = [x for (ww, _), r in runs.items() if ww == w for x in r["systems"].values()]
        if s:
            walls, pts = [x["wall_s"] for x in s], [x["num_points"] for x in s]
            lines.append(f"| {w} | {len(s)} | {statistics.median(walls):.1f} | {max(walls):.1f} | "
                         f"{statistics.median(pts):g} | {max(pts)} |")
    return "\n".join(lines)


def plot_curves(runs: dict, workload: str, path: Path, layout: Layout = PAPER) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), sharey=True)
    for ax, corner in zip(axes, CORNERS):
        run = runs.get((workload, corner))
        if run is None:
            continue
        split, _ = best_tetri(run["systems"])
        for name in ("vllm", "sarathi", split, "adaptive"):
            s = run["systems"][name]
            pts = sorted(s["points"])
            g = s["goodput_per_device"]
            ax.plot([r for r, _ in pts], [100 * a for _, a in pts], marker="o", markersize=3,
                    label=f"{name}: {g:.3g}/device" if g is not None else f"{name}: none")
        ax.axhline(90, color="black", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        where = "4 V100s" if layout is PAPER else f"{layout.devices} CPU instances"
        ax.set(title=f"{workload}, {corner}", xlabel=f"arrival rate, req/s ({where})", ylim=(-2, 102))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower left")
    axes[0].set_ylabel("requests meeting every SLO (%)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def shrunk(trace: dict) -> dict:
    """How a CPU run's trace was fitted: mean lengths after the shrink, and what the fit changed."""
    n = max(1, trace["num_requests"])
    return {"prompt_mean": round(trace["prompt_tokens"] / n, 1), "output_mean": round(trace["output_tokens"] / n, 1),
            "changes": trace["changes"]}


def load_run(f: Path) -> dict:
    """One cell's search (``W_C.json``), each real system with its simulated twin's knee from the log."""
    run = json.loads(f.read_text())
    for name, rate in simulated_knees(f.with_suffix(".log")).items():
        run["systems"].get(name, {}).setdefault("estimated_knee_rate", rate)
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--cpu", action="store_true", help="benchmarks/goodput_cpu.sh's runs (two CPU instances)")
    p.add_argument("--json", default=None, help="write the small result file here")
    p.add_argument("--plots", default=None, help="write the attainment curves of Mixed and Azure here")
    p.add_argument("--overlay", action="append", default=[], help="a later run of some systems "
                   "(SYSTEMS=... goodput_paper.sh OUT2): its systems replace OUT_DIR's, cell by cell; repeatable")
    p.add_argument("--caveat", action="append", default=[], help="a sentence the results page prints beside "
                   "the table (e.g. a point that ran beside other load); repeatable")
    p.add_argument("--into", default=None, help="a committed result file (results/goodput_paper.json): "
                   "OUT_DIR's systems replace its cells and curves, the rest stays; written back in place")
    a = p.parse_args(argv)
    layout = CPU if a.cpu else PAPER
    runs = {}
    for w in WORKLOADS + REPORT_ONLY:
        for c in CORNERS:
            f = Path(a.out_dir) / f"{w}_{c}.json"
            if f.exists():
                runs[(w, c)] = load_run(f)
    if not runs:
        print(f"no runs in {a.out_dir}", file=sys.stderr)
        return 1
    abouts = {(r["about"]["commit"], r["about"]["date"][:10], r["about"]["machine"]) for r in runs.values()}
    for extra in a.overlay:
        for (w, c), run in runs.items():
            f = Path(extra) / f"{w}_{c}.json"
            if f.exists():
                later = load_run(f)
                run["systems"].update(later["systems"])
                abouts.add((later["about"]["commit"], later["about"]["date"][:10], later["about"]["machine"]))
    tuned = {k: row_cells(r) for k, r in runs.items() if k[0] in WORKLOADS}
    held = {k: row_cells(r) for k, r in runs.items() if k[0] in REPORT_ONLY}
    print(markdown(tuned, "workload"))
    if held:
        print("\nReport-only (nothing tuned on it):\n")
        print(markdown(held, "trace"))
    print("\n" + wall_times(runs))
    prefix = "goodput_cpu_" if a.cpu else "goodput_"
    if a.into:
        systems = sorted({n for r in runs.values() for n in r["systems"]})
        how = (f"SYSTEMS={','.join(systems)} {layout.script} OUT3 && python benchmarks/goodput_table.py OUT3"
               + (" --cpu" if a.cpu else "") + f" --into {a.into}")
        Path(a.into).write_text(json.dumps(merge_into(Path(a.into), runs, abouts, how), indent=1) + "\n")
        print(f"\nmerged {', '.join(systems)} into {a.into}")
    if a.json:
        first = next(iter(runs.values()))
        abouts = sorted(abouts)
        data = {
            "device": layout.device, "devices_per_system": layout.devices, "target": first["search"]["target"],
            "corners": {c: runs[k]["slo"]["terms"] for k in runs for c in [k[1]]},
            "limits": {f"{w} {c}": r["slo"]["line"] for (w, c), r in runs.items()} if a.cpu else None,
            "workloads": {w: {"source": r["trace"]["source"], "num_requests": r["trace"]["num_requests"],
                              "tuned_on": w in WORKLOADS,
                              **(shrunk(r["trace"]) if a.cpu else {})} for (w, _), r in runs.items()},
            "cells": [{"workload": w, "corner": c, **v} for (w, c), cells in {**tuned, **held}.items()
                      for v in cells.values()],
            "curves": {w: {c: curves_of(runs[(w, c)]) for c in CORNERS if (w, c) in runs} for w in CURVES},
        }
        if a.caveat:
            data["caveats"] = a.caveat
        if a.cpu:
            data["curve"] = ["Mixed", "balanced"]  # the plot on the results page
        else:
            del data["limits"]
        result = {"meta": {
            "order": layout.order, "kind": "goodput", "title": layout.title, "question": layout.question,
            "machine": "; ".join(sorted({m for _, _, m in abouts})),
            "commit": ", ".join(sorted({c for c, _, _ in abouts})),
            "date": ", ".join(sorted({d for _, d, _ in abouts})),
            "command": f"{layout.script} OUT" + "".join(f" && SYSTEMS=... {layout.script} OUT{i + 2}" for i in range(len(a.overlay)))
                       + " && python benchmarks/goodput_table.py OUT" + (" --cpu" if a.cpu else "")
                       + "".join(f" --overlay OUT{i + 2}" for i in range(len(a.overlay)))
                       + f" --json {a.json}" + (f" --plots {a.plots}" if a.plots else "")
                       + "".join(" --caveat '...'" for _ in a.caveat),
            "wall_time": f"{sum(s['wall_s'] for r in runs.values() for s in r['systems'].values()) / 60:.0f} min "
                         f"({len(runs)} searches of {len(first['systems'])} systems each"
                         + (", real time, nothing else running)" if a.cpu else ", virtual time)"),
            "notes": "docs/notes/goodput.md", "source": layout.source},
            "data": data}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {a.json}")
    if a.plots:
        for w in CURVES:
            if any((w, c) in runs for c in CORNERS):
                print(f"wrote {plot_curves(runs, w, Path(a.plots) / f'{prefix}{w}.png', layout)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
