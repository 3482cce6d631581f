#!/usr/bin/env python3
"""The `sim:` sections of docs/RESULTS.md, a slice of each rerun in minutes and compared with its file.

    benchmarks/sim_check.py [OUT]          # make results-sim-check; OUT defaults to a temporary folder

A simulated device runs on virtual time, so a rerun at the same code gives the same figures to the
last digit on any machine: a slice that differs means the code's behaviour changed since the file
was written (then rerun that section whole, with the command its section names). The full
sections take 9 minutes (the ablation) to two and a half hours (the paper grid) on two cores; the
slices, run one after another:

- Goodput at paper scale (results/goodput_paper.json): the Mixed workload at the balanced corner,
  every system's search (``benchmarks/goodput_paper.sh`` with WORKLOADS=Mixed CORNERS=balanced),
  against the file's vllm, sarathi, best tetri split and adaptive goodput per device.
- Prefix caching at paper scale (results/prefix_cache_sim.json): the replay step of vllm and
  adaptive, all three ways each (``benchmarks/prefix_cache_sim.py run --steps replay`` at the
  file's rate), against the file's hit rate, TTFT, KV moved, evictions and preemptions.
- The ablation (results/fig_ablation.json): Figure 16 in our setting, the five workloads
  (``benchmarks/fig_ablation.py run --only fig16 --conditions ours``), against the file's TTFT,
  JCT and perf/$ gains and each side's mean JCT.

Prints a row per figure (file, rerun, same or not) and exits 1 if any differs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _data(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())["data"]


def _run(argv: list, log: Path, env: dict | None = None) -> float:
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run([str(a) for a in argv], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}).returncode
    if rc:
        raise SystemExit(f"{' '.join(map(str, argv[:3]))} ... failed (rc {rc}); its output: {log}")
    return time.monotonic() - t0


def same(a, b) -> bool:
    """Equal to the last digit a JSON float keeps (a relative 1e-9 for the sum order of a platform's libm)."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    return a == b


def grid(out: Path) -> list[tuple]:
    from goodput_table import best_tetri, split_of  # how the file's table picked and named the split

    wall = _run(["bash", "benchmarks/goodput_paper.sh", out], out / "grid.log",
                {"PY": sys.executable, "WORKLOADS": "Mixed", "CORNERS": "balanced"})
    run = json.loads((out / "Mixed_balanced.json").read_text())["systems"]
    mine = {c["system"]: c for c in _data("goodput_paper")["cells"]
            if c["workload"] == "Mixed" and c["corner"] == "balanced"}
    tetri, best = best_tetri(run)
    rows = []
    for system, name in (("vllm", "vllm"), ("sarathi", "sarathi"), ("tetri", tetri), ("adaptive", "adaptive")):
        rows.append(("goodput_paper", f"Mixed balanced {system} goodput/device",
                     mine[system]["goodput_per_device"], run[name]["goodput_per_device"]))
    rows.append(("goodput_paper", "Mixed balanced tetri's best split", mine["tetri"]["split"], split_of(tetri, best)))
    return rows, wall


def prefix(out: Path) -> list[tuple]:
    from prefix_cache_sim import replay_rows

    d = _data("prefix_cache_sim")
    rate = d["replay"]["rate"]
    wall = _run([sys.executable, "benchmarks/prefix_cache_sim.py", "run", out, "--requests", d["workload"]["num_requests"],
                 "--systems", "vllm,adaptive", "--steps", "replay", "--replay-rate", rate], out / "prefix.log")
    run = replay_rows(json.loads((out / "replay.json").read_text()))
    rows = []
    for name in run:
        for key in ("hit_rate", "ttft_mean_s", "ttft_p99_s", "kv_bytes_moved", "evictions", "preemptions"):
            rows.append(("prefix_cache_sim", f"{name} {key} at {rate:g} req/s",
                         d["replay"]["systems"][name][key], run[name][key]))
    return rows, wall


def ablation(out: Path) -> list[tuple]:
    from fig_ablation import fig16_data

    wall = _run([sys.executable, "benchmarks/fig_ablation.py", "run", out, "--only", "fig16", "--conditions", "ours"],
                out / "ablation.log")
    run = fig16_data(out)["ours"]["cells"]
    mine = _data("fig_ablation")["fig16"]["ours"]["cells"]
    return [("fig_ablation", f"ours {w} {key}", mine[w][key], run[w][key])
            for w in mine for key in ("ttft", "jct", "perf", "ts_jct_s", "vllm_jct_s")], wall


SLICES = {"goodput_paper": grid, "prefix_cache_sim": prefix, "fig_ablation": ablation}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=None, help="where the reruns go (default: a temporary folder)")
    p.add_argument("--only", default=None, help=f"comma-separated, of {', '.join(SLICES)}")
    a = p.parse_args(argv)
    wanted = a.only.split(",") if a.only else list(SLICES)
    if set(wanted) - set(SLICES):
        p.error(f"--only: unknown {', '.join(sorted(set(wanted) - set(SLICES)))} (known: {', '.join(SLICES)})")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(a.out).resolve() if a.out else Path(tmp)
        rows, differ = [], 0
        for name in wanted:
            out = base / name
            out.mkdir(parents=True, exist_ok=True)
            print(f"{name}: rerunning its slice ...", flush=True)
            got, wall = SLICES[name](out)
            bad = sum(not same(f, r) for _, _, f, r in got)
            differ += bad
            print(f"{name}: {len(got) - bad} of {len(got)} figures the same, {wall:.0f} s", flush=True)
            rows += got
    print("\n| section | figure | file | rerun | same |\n|---|---|---:|---:|---|")
    for section, what, f, r in rows:
        print(f"| {section} | {what} | {f} | {r} | {'yes' if same(f, r) else '**no**'} |")
    print(f"\n{len(rows) - differ} of {len(rows)} figures the same"
          + ("" if not differ else ": the code's behaviour changed since those files were written"))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
