#!/usr/bin/env python3
"""How much room the paper-scale goodput grid leaves above its best system (issue 55).

    .venv/bin/python benchmarks/goodput_headroom.py OUT_DIR [--grid results/goodput_paper.json] \
        [--corner balanced] [--factor 1.3] [--workloads LPLD,LPHD,...]

Two figures per workload, beside the grid's knees (results/goodput_paper.json):

- **The sustained-rate bound.** On a hardware profile (``sim:opt-13b-v100-32gb``) a step costs
  F + r x rows + a x prompt pairs + k x decode context (aserve/devices/sim_device.py
  ``hardware_cost``: additive, no contention). A trace fixes its rows, pairs and context whatever
  the schedule (a prompt chunked any way has the same pairs); only the number of steps is the
  scheduler's, and it is at least the KV the decode steps hold (each decode of a request at
  context c holds c tokens, in blocks) over the KV one device has. So the trace needs at least
  T_min = F x (KV held / KV per device) + r x rows + a x pairs + k x context device-seconds, and no
  schedule sustains more than n / T_min requests a second per device: every step full of KV,
  no queue, no preemption. It is a steady-state bound; a finite trace can run past it for a
  while (its work spills past the last arrival), which is why LPLD's burst knees lie above it.
- **The devices at the knee.** The best system of the row (vllm, sarathi or tetri's best split)
  and adaptive replayed at the best knee and at ``--factor`` times it: SLO attainment, device
  seconds per request, and the devices' busy share of the makespan.

A replay whose JSON is in OUT_DIR is not run again. Virtual time: the figures do not depend on
the machine.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from aserve.devices.sim_device import load_profile  # noqa: E402
from aserve.replay.traces import FitOptions, load_trace  # noqa: E402

PROFILE = "opt-13b-v100-32gb"
BLOCK = 16
SYSTEMS = {"vllm": "--mode coupled --instances 4 --batching vllm",
           "sarathi": "--mode coupled --instances 4 --batching sarathi",
           "tetri": "--mode disagg --prefill {p} --decode {d}",
           "adaptive": "--mode adaptive --prefill 2 --decode 2"}


def step_terms(profile) -> dict:
    """The additive profile's pieces: a step's fixed seconds, a row's, a prompt pair's, a context token's."""
    cost = profile.cost
    row = cost.linear(2) - cost.linear(1)
    kv_tokens = profile.kv_capacity_bytes // profile.model_args().kv_bytes_per_token // BLOCK * BLOCK
    return {"F": cost.linear(1) - row, "r": row, "a": cost.attn_prefill_s, "k": cost.attn_decode_s, "K": kv_tokens}


def request_work(p: int, o: int) -> tuple[int, float, int, int]:
    """Rows, prompt pairs, decode context read, and KV tokens held over the decode steps (by block)."""
    decodes = range(1, o)
    return (p + o - 1, p * (p + 1) / 2, sum(p + t for t in decodes),
            sum(math.ceil((p + t) / BLOCK) * BLOCK for t in decodes))


def min_device_seconds(lengths, terms: dict) -> tuple[float, float]:
    """(T_min, of which the steps' fixed part) for requests of (prompt, output) lengths."""
    rows = pairs = ctx = held = 0.0
    for p, o in lengths:
        w = request_work(p, o)
        rows, pairs, ctx, held = rows + w[0], pairs + w[1], ctx + w[2], held + w[3]
    steps_s = terms["F"] * held / terms["K"]
    return steps_s + terms["r"] * rows + terms["a"] * pairs + terms["k"] * ctx, steps_s


def replay(out: Path, name: str, source: str, n: int, rate: float, corner: str, systems: dict) -> dict:
    path = out / f"{name}.json"
    if not path.exists():
        cmd = [sys.executable, "cli.py", "replay", source, "--num-requests", str(n), "--rate", f"{rate:.6g}",
               "--device", f"sim:{PROFILE}", "--slo", corner, "--no-progress", "--json", str(path),
               "--compare", " ; ".join(f"{k}: {v}" for k, v in systems.items())]
        subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, check=True)
    return json.loads(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--grid", type=Path, default=ROOT / "results" / "goodput_paper.json")
    ap.add_argument("--corner", default="balanced")
    ap.add_argument("--factor", type=float, default=1.3)
    ap.add_argument("--workloads", default="LPLD,LPHD,HPLD,HPHD,Mixed,Azure")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    grid = json.loads(a.grid.read_text())["data"]
    terms = step_terms(load_profile(PROFILE))
    print(f"{PROFILE}: a step {terms['F'] * 1e3:.2f} ms fixed + {terms['r'] * 1e3:.3f} ms a row + "
          f"{terms['a'] * 1e9:.2f} ns a prompt pair + {terms['k'] * 1e6:.3f} us a context token; "
          f"KV {terms['K']} tokens a device\n")
    print(f"| workload | bound / device | best other ({a.corner}) | of bound | x{a.factor:g} of bound | adaptive | "
          f"system at the knee: attainment, device s / request (x T_min's), busy share | at x{a.factor:g} the knee |")
    print("|---|---:|---|---:|---:|---:|---|---|")
    for w in a.workloads.split(","):
        info = grid["workloads"][w]
        trace = load_trace(info["source"], FitOptions(num_requests=info["num_requests"], context_window=2048))
        lengths = [(q.prompt_tokens, q.output_tokens) for q in trace.requests]
        t_min, _ = min_device_seconds(lengths, terms)
        bound = len(lengths) / t_min
        cells = {c["system"]: c for c in grid["cells"] if c["workload"] == w and c["corner"] == a.corner}
        best = max((c for c in cells.values() if c["system"] != "adaptive"), key=lambda c: c["goodput_per_device"])
        split = best["split"] or ""
        label = best["system"] + (f" {split}" if split else "")
        base = best["system"].split("-")[0]
        pd = re.fullmatch(r"(\d+)P\+(\d+)D", split)
        sysargs = {base: SYSTEMS[base].format(p=pd and pd[1], d=pd and pd[2]), "adaptive": SYSTEMS["adaptive"]}
        figs = []
        for f in (1.0, a.factor):
            r = replay(a.out, f"{w}_{a.corner}_x{f:g}", info["source"], info["num_requests"], best["knee_rate"] * f,
                       a.corner, sysargs)
            figs.append("; ".join(
                f"{k} {s['slo_attainment']:.0%}, {s['resource_usage_s'] / s['completed']:.2f} s "
                f"(x{s['resource_usage_s'] / t_min:.2f}), {s['resource_usage_s'] / (s['devices'] * s['makespan_s']):.0%}"
                for k, s in r["systems"].items()))
        g, ad = best["goodput_per_device"], cells["adaptive"]["goodput_per_device"]
        print(f"| {w} | {bound:.3g} | {label} {g:.3g} | {g / bound:.2f} | {a.factor * g / bound:.2f} | "
              f"{ad:.3g} ({ad / g:.2f}x) | {figs[0]} | {figs[1]} |", flush=True)


if __name__ == "__main__":
    main()
