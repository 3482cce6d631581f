#!/usr/bin/env python3
"""Issue 58's held-out validation: a frozen profile predicts each real run before it runs.

    aserve profile device --threads 1 --out P.json              # once, on a machine at rest
    benchmarks/sim_heldout.py run OUT --profile P.json [--workloads Mixed,Azure] [--rate-from sarathi]
    benchmarks/sim_heldout.py run OUT2 --profile P.json          # optional: the same real runs again
    benchmarks/sim_heldout.py table OUT [--repeat OUT2] [--knees GP_DIR ...] [--json results/simulator_error.json]

``run``, per workload (the goodput rows' shrunk traces: the first 32 requests, lengths x0.1, two
instances of one thread each, 0.5 GiB of KV an instance, the balanced corner):

1. the rate: the knee of ``--rate-from`` (sarathi) found on the simulated device, so each run sits
   where attainment starts to fall and the error matters most;
2. the prediction: the four systems replayed on ``sim:P.json`` at that rate, written before the
   real run starts (its file's time and the profile's sha256 are kept);
3. the real run: the same command on ``--device cpu``, with its step log and /proc/stat's steal
   and busy time read before and after.

Every workload is predicted before the first real run starts (``--predict-only`` stops there and
says how long the real runs will take). Nothing of a real run feeds a prediction: the profile is
read as it was frozen, and the rate is the simulator's. What exists is not run again (a cut-off
run resumes).

``table`` prints, per workload and system, real / predicted (error) for mean TTFT, mean JCT, P99
token gap and the share of requests within the SLOs, and beside them what the machine did while
the real run ran: the steps' speed against the frozen profile (the median measured / predicted
time of its decode-only steps, and the range of that over 30 s windows) and the CPU time stolen
by the hypervisor. That speed bounds the machine's drift from the profile's minutes together with
the profile's own error on decode steps (its held-out checks, printed at the top). ``--knees``
adds each goodput search's (benchmarks/goodput_cpu.sh) real knee beside its simulated twin's;
``--repeat`` each real figure's difference from a second real run of the same command (the
machine's own spread, beside the simulator's error).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # side_by_side.py, a tool

from side_by_side import latency, pct_diff  # noqa: E402

DATA = Path(os.environ.get("DATA", ROOT.parent / "shared" / "data" / "traces"))
WORKLOADS = {"LPLD": "traces/LPLD.jsonl", "LPHD": "traces/LPHD.jsonl", "HPLD": "traces/HPLD.jsonl",
             "HPHD": "traces/HPHD.jsonl", "Mixed": "traces/Mixed.jsonl",
             "Azure": str(DATA / "azure2023_conv.csv"), "AzureCode": str(DATA / "azure2023_code.csv")}
SYSTEMS = {"vllm": "--mode coupled --instances 2 --batching vllm",
           "sarathi": "--mode coupled --instances 2 --batching sarathi",
           "tetri": "--mode disagg --prefill 1 --decode 1",
           "adaptive": "--mode adaptive --prefill 1 --decode 1"}
FIT = "--num-requests 32 --length-scale 0.1 --threads 2 --kv-cache-gb 0.5 --slo balanced --no-progress"
# the figures: (label, report key, statistic, limit)
METRICS = (("TTFT mean", "ttft", "mean", 0.10), ("JCT mean", "jct", "mean", 0.10),
           ("token gap P99", "token_gap", "p99", 0.20))
WINDOW_S = 30.0


def compare(names) -> str:
    return " ; ".join(f"{n}: {SYSTEMS[n]}" for n in names)


def cli(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "cli.py"), *args]


def proc_stat() -> dict:
    """Every CPU's seconds so far from /proc/stat (aserve/profiles/rest.py reads it): busy
    (user..softirq), steal, and all of them with idle."""
    from aserve.profiles.rest import busy_seconds

    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        text = f.read()
    return {"busy_s": busy_seconds(text, ticks, fields=(0, 1, 2, 5, 6)),
            "steal_s": busy_seconds(text, ticks, fields=(7,)),
            "total_s": busy_seconds(text, ticks, fields=range(8)), "wall_s": time.time()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_logged(cmd: list[str], log: Path) -> None:
    print("  $ " + " ".join(shlex.quote(c) for c in cmd[1:]), flush=True)
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"failed (exit {rc}); see {log}")


def knee_rate(path: Path, system: str) -> float:
    s = json.loads(path.read_text())["systems"][system]
    if s["knee_rate"] is None:
        raise SystemExit(f"{path}: {system} has no knee on the simulated device (nothing passed); pick another "
                         "--rate-from")
    return s["knee_rate"]


def run(a) -> int:
    profile = Path(a.profile).resolve()
    meta = json.loads(profile.read_text()).get("meta", {})
    rest = meta.get("rest") or {}
    if not rest.get("at_rest") and not a.allow_busy:
        raise SystemExit(f"{profile}: not measured at rest ({rest.get('why') or 'no rest record'}); measure it with "
                         "'aserve profile device --threads 1 --out P.json' on a quiet machine (or --allow-busy)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in a.systems.split(",") if n]
    for n in names:
        if n not in SYSTEMS:
            raise SystemExit(f"--systems: unknown system {n!r} (known: {', '.join(SYSTEMS)})")
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    workloads = a.workloads.split(",")
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"--workloads: unknown workload {w!r} (known: {', '.join(WORKLOADS)})")
    sim, digest, rates = f"sim:{profile}", sha256(profile), {}
    for w in workloads:  # every prediction first, before any real run
        rates[w] = predict(out, w, sim, names, a.rate_from, profile.name)
    left = [w for w in workloads if not (out / f"{w}_meta.json").exists()]
    if left:
        guess = sum(max(s["makespan_s"] for s in json.loads((out / f"{w}_sim.json").read_text())["systems"].values())
                    for w in left) * len(names)
        print(f"predicted: the real runs of {', '.join(left)} take about {guess / 60:.0f} min (the simulated makespans, "
              "each system in turn)", flush=True)
    if a.predict_only:
        return 0
    for w in left:
        print(f"{w}: the real run at {rates[w]} req/s", flush=True)
        before = proc_stat()
        run_logged(cli("replay", *replay_args(w, rates[w], names), "--device", "cpu",
                       "--json", str(out / f"{w}_real.json"), "--step-log", str(out / f"{w}_steps.jsonl")),
                   out / f"{w}_real.log")
        after = proc_stat()
        d = {k: after[k] - before[k] for k in after}
        (out / f"{w}_meta.json").write_text(json.dumps({
            "workload": w, "trace": WORKLOADS[w], "fit": FIT, "rate": rates[w], "rate_from": a.rate_from,
            "commit": commit, "profile": str(profile), "profile_sha256": digest,
            "predicted_at": (out / f"{w}_sim.json").stat().st_mtime, "real_started_at": before["wall_s"],
            "real_wall_s": d["wall_s"], "steal_fraction": d["steal_s"] / d["total_s"] if d["total_s"] > 0 else None,
            "busy_cores": d["busy_s"] / d["wall_s"] if d["wall_s"] > 0 else None}, indent=1))
    return 0


def replay_args(w: str, rate: float, names) -> list[str]:
    return [WORKLOADS[w], *FIT.split(), "--rate", str(rate), "--compare", compare(names)]


def predict(out: Path, w: str, sim: str, names, rate_from: str, profile_name: str) -> float:
    """``w``'s rate (``rate_from``'s knee on the simulated device) and its four systems' prediction
    there (kept where a cut-off run left them)."""
    knee = out / f"{w}_knee_sim.json"
    if not knee.exists():
        print(f"{w}: the rate ({rate_from}'s knee on {profile_name})", flush=True)
        run_logged(cli("bench", "goodput", WORKLOADS[w], *FIT.split(), "--device", sim, "--precision", "0.1",
                       "--compare", compare([rate_from]), "--json", str(knee)), out / f"{w}_knee_sim.log")
    rate = round(knee_rate(knee, rate_from), 4)
    if not (out / f"{w}_sim.json").exists():
        print(f"{w}: predicting at {rate} req/s", flush=True)
        run_logged(cli("replay", *replay_args(w, rate, names), "--device", sim, "--json", str(out / f"{w}_sim.json")),
                   out / f"{w}_sim.log")
    return rate


def step_speed(profile, steps_path: Path, system: str) -> dict:
    """The decode-only steps' median measured / predicted against the frozen profile, whole run and
    per WINDOW_S (the lowest and highest window with at least 10 such steps), and the prompt
    steps' (chunks, alone or with decodes) median over the whole run."""
    from aserve.engine.step_log import read_steps
    from aserve.profiles.calibrate import speed, usable

    steps = usable(read_steps([steps_path], systems={system}))
    decodes = [s for s in steps if s.kind == "decode"]
    prompt = speed(profile, steps, on="prompt") if len(decodes) < len(steps) else None
    if not decodes:
        return {"speed": None, "lo": None, "hi": None, "steps": 0, "prompt_speed": prompt}
    windows: dict[int, list] = {}
    for s in decodes:
        windows.setdefault(int(s.t // WINDOW_S), []).append(s)
    meds = [speed(profile, v, on="decode") for v in windows.values() if len(v) >= 10]
    return {"speed": speed(profile, decodes, on="decode"), "lo": min(meds) if meds else None,
            "hi": max(meds) if meds else None, "steps": len(decodes), "prompt_speed": prompt}


def rows_of(out: Path, w: str, profile) -> list[dict]:
    real = json.loads((out / f"{w}_real.json").read_text())["systems"]
    sim = json.loads((out / f"{w}_sim.json").read_text())["systems"]
    meta = json.loads((out / f"{w}_meta.json").read_text())
    rows = []
    for name in real:
        if name not in sim:
            continue
        cells = []
        for label, key, stat, limit in METRICS:
            r, s = latency(real[name], key, stat), latency(sim[name], key, stat)
            err = pct_diff(r, s)
            cells.append({"metric": label, "real": r, "sim": s, "error": None if err is None else err / 100,
                          "limit": limit})
        speed = step_speed(profile, out / f"{w}_steps.jsonl", name)
        rows.append({"workload": w, "system": name, "rate": meta["rate"], "cells": cells,
                     "attainment": [real[name].get("slo_attainment"), sim[name].get("slo_attainment")],
                     "step_speed": speed, "steal": meta["steal_fraction"]})
    return rows


def add_repeat(rows: list[dict], again: Path) -> None:
    """Each cell's ``repeat``: a second real run of the same command (the same rate, settings and
    profile, run after the first) against the first, as the simulated one is: the machine's own
    spread on that figure, which no prediction can be held to beat."""
    for r in rows:
        second = json.loads((again / f"{r['workload']}_real.json").read_text())["systems"].get(r["system"])
        for (label, key, stat, _), c in zip(METRICS, r["cells"]):
            b = latency(second, key, stat) if second else None
            err = pct_diff(c["real"], b) if b is not None else None
            c["repeat"], c["real_again"] = (None if err is None else err / 100), b


def knees_of(gp_dir: Path) -> list[dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from goodput_table import load_run  # noqa: E402 - a harness beside this one

    out = []
    for f in sorted(gp_dir.glob("*_*.json")):
        run_ = load_run(f)
        w, corner = f.stem.split("_", 1)
        for name, s in run_["systems"].items():
            est = s.get("estimated_knee_rate")
            if s.get("knee_rate") is None or est is None:
                continue
            out.append({"workload": w, "corner": corner, "system": name, "real": s["knee_rate"], "sim": est,
                        "error": est / s["knee_rate"] - 1.0, "bracket": s["knee_bracket"]})
    return out


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def table(a) -> int:
    from aserve.profiles.cost_model import CostModel

    out = Path(a.out)
    metas = sorted(out.glob("*_meta.json"))
    if not metas:
        raise SystemExit(f"{out}: no run (nothing named W_meta.json): run 'benchmarks/sim_heldout.py run' first")
    first = json.loads(metas[0].read_text())
    profile_path = Path(first["profile"])
    profile = CostModel.load(profile_path)
    order = {w: i for i, w in enumerate(WORKLOADS)}
    workloads = sorted((m.name.removesuffix("_meta.json") for m in metas), key=lambda w: order.get(w, 99))
    rows, shas = [], set()
    for w in workloads:
        meta = json.loads((out / f"{w}_meta.json").read_text())
        shas.add(meta["profile_sha256"])
        rows += rows_of(out, w, profile)
    if a.repeat:
        add_repeat(rows, Path(a.repeat))
    if len(shas) > 1:
        print("warning: the workloads were predicted from different profiles")
    checks = profile.meta.get("checks", [])
    print(f"profile {profile_path.name} ({profile.meta.get('date')}, {profile.meta.get('machine')}, "
          f"{profile.meta.get('threads')} thread), its held-out checks: "
          + ", ".join(f"{c['step']} {c['error']:+.1%}" for c in checks))
    head = " | ".join(f"{m[0]} real / sim (err)" for m in METRICS)
    print(f"\n| workload | system | req/s | {head} | within SLOs real / sim | decode steps / profile (30 s windows) / prompt steps "
          f"| steal |")
    print("|---|---|---:|" + "---|" * (len(METRICS) + 3))
    over = total = 0
    for r in rows:
        cells = []
        for c in r["cells"]:
            bad = c["error"] is None or abs(c["error"]) > c["limit"]
            over, total = over + bad, total + 1
            err = "n/a" if c["error"] is None else f"{c['error']:+.0%}"
            cells.append(f"{fmt(c['real'])} / {fmt(c['sim'])} ({err}{' !' if bad else ''})")
        sp = r["step_speed"]
        speed = "n/a" if sp["speed"] is None else (f"{sp['speed']:.2f}" + (
            f" ({sp['lo']:.2f}-{sp['hi']:.2f})" if sp["lo"] is not None else ""))
        speed += " / " + ("n/a" if sp.get("prompt_speed") is None else f"{sp['prompt_speed']:.2f}")
        ra, sa = r["attainment"]
        if "repeat" in r["cells"][0]:
            cells = [f"{x} [again {'n/a' if c['repeat'] is None else format(c['repeat'], '+.0%')}]"
                     for x, c in zip(cells, r["cells"])]
        print(f"| {r['workload']} | {r['system']} | {r['rate']:.3g} | " + " | ".join(cells)
              + f" | {ra:.0%} / {sa:.0%} | {speed} | {r['steal']:.1%} |")
    print(f"\n{over} of {total} cells over their limit (means 10%, P99 20%).")
    if a.repeat:
        again = [c for r in rows for c in r["cells"]]
        print(f"The same real runs drawn again ({a.repeat}, [again]: the second real run against the first): "
              f"{sum(c['repeat'] is None or abs(c['repeat']) > c['limit'] for c in again)} of {len(again)} "
              "cells differ by more than the limit.")
    knees = []
    for d in a.knees:
        knees += knees_of(Path(d))
    if knees:
        print("\n| workload | corner | system | knee req/s real | simulated twin | twin / real |")
        print("|---|---|---|---:|---:|---:|")
        for k in knees:
            print(f"| {k['workload']} | {k['corner']} | {k['system']} | {k['real']:.3g} | {k['sim']:.3g} | "
                  f"{k['sim'] / k['real']:.2f}x |")
        kover = sum(abs(k["error"]) > 0.10 for k in knees)
        print(f"\n{kover} of {len(knees)} knees off by more than 10%.")
    if a.json:
        write_results(Path(a.json), out, profile, profile_path, workloads, rows, knees, over, total, a.caveat, a.source, a.label)
    return 0


def write_results(path: Path, out: Path, profile, profile_path: Path, workloads: list, rows: list, knees: list,
                  over: int, total: int, caveats: list, source: str, label: str = "") -> None:
    """The results page's file (scripts/results_page.py, kind ``simulator``): this run's rows and
    knees, and the earlier validations' counts carried over from the file it replaces."""
    metas = [json.loads((out / f"{w}_meta.json").read_text()) for w in workloads]
    whole = json.loads(path.read_text()) if path.exists() else {"meta": {}, "data": {}}
    before = whole["data"]
    history = [dict(v) for v in before.get("validations", [])]
    for v in history:  # the file being replaced counted one validation from its own table: keep the count
        if "over" not in v and v.get("cells_from") == "cells":
            v["over"], v["of"] = _old_table_count(before)
            del v["cells_from"]
    if before.get("label") and "over" in before and not any(v["label"] == before["label"] for v in history):
        # the held-out validation this file replaces becomes one of the earlier ones
        history.append({"label": before["label"], "date": whole["meta"].get("date", ""),
                        "commit": whole["meta"].get("commit", ""), "fitted_on": None, "frozen": True,
                        "over": before["over"], "of": before["cells"],
                        "what": f"{before['profile']['what']}, {whole['meta'].get('machine', '').split(',')[0]}"})
    pm = profile.meta
    when = time.strftime("%Y-%m-%d", time.gmtime(min(m.get("predicted_at", 0) for m in metas)))
    doc = {"meta": {
        "order": 50, "kind": "simulator", "title": "The simulator's error",
        "question": "How close is a replay on the simulated device (--device sim:PROFILE) to the same replay on the "
                    "real CPU, predicted from a profile frozen before the runs?",
        "machine": f"{pm.get('machine')}, {', '.join(pm.get('cpu_flags') or [])}, {pm.get('dtype')}",
        "commit": ", ".join(sorted({m["commit"] for m in metas})), "date": when,
        "command": "aserve profile device --threads 1 --out P.json   # once, at rest\n"
                   "benchmarks/sim_heldout.py run OUT --profile P.json   # per workload: predict, then run\n"
                   "benchmarks/sim_heldout.py run OUT2 --profile P.json   # the same real runs again\n"
                   "benchmarks/sim_heldout.py table OUT --repeat OUT2 --knees GP --json results/simulator_error.json   "
                   "--caveat '...'   # GP: benchmarks/goodput_cpu.sh's folder, its twin on the same profile",
        "wall_time": f"{sum(m['real_wall_s'] for m in metas) / 60:.0f} min of real runs, nothing else running",
        "notes": "docs/notes/simulator.md",
        "source": source},
        "data": {"limits_pct": {"mean": 10, "p99": 20}, "drift_limit": 0.03, "systems": list(SYSTEMS),
                 "tuned_on": [w for w in WORKLOADS if w != "AzureCode"],
                 "label": label or f"{when} frozen profile, held out",
                 "profile": {"file": profile_path.name, "sha256": metas[0]["profile_sha256"],
                             "what": f"{pm.get('date')}, {pm.get('threads')} thread, at rest",
                             "checks": pm.get("checks", [])},
                 "rows": rows, "knees": knees, "over": over, "cells": total,
                 "fit": FIT, "validations": history, "caveats": caveats}}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


    return 0


def _old_table_count(data: dict) -> tuple[int, int]:
    """Cells over of the replaced file's table (runs of six figures: three means, three P99s)."""
    lim, cells = data["limits_pct"], [(m, c) for r in data["cells"]["runs"] for m, c in zip(data["metrics"], r["cells"])]
    return sum(abs(c[2]) > (lim["p99"] if "P99" in m else lim["mean"]) for m, c in cells), len(cells)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="predict, then run, each workload")
    r.add_argument("out")
    r.add_argument("--profile", required=True, help="the frozen profile (aserve profile device --threads 1 --out P)")
    r.add_argument("--workloads", default="LPLD,LPHD,HPLD,HPHD,Mixed,Azure,AzureCode")
    r.add_argument("--systems", default=",".join(SYSTEMS))
    r.add_argument("--rate-from", default="sarathi", help="the system whose simulated knee sets each run's rate")
    r.add_argument("--allow-busy", action="store_true", help="use a profile not measured at rest")
    r.add_argument("--predict-only", action="store_true", help="the rates and predictions only (the simulated "
                   "device: minutes, any machine), with the real runs' expected wall time")
    t = sub.add_parser("table", help="the error table of a run's folder")
    t.add_argument("out")
    t.add_argument("--knees", action="append", default=[], help="a benchmarks/goodput_cpu.sh folder (repeatable)")
    t.add_argument("--json", default=None, help="write the results page's file here (kind simulator), keeping the "
                   "earlier validations' counts of the file it replaces")
    t.add_argument("--repeat", default=None, help="a second 'run' folder of the same runs (the same profile): each "
                   "cell's real-against-real difference beside its error")
    t.add_argument("--source", default="The frozen profile on held-out runs, this Xeon (issue 58), 2026-11-30",
                   help="the notes section the results page links to")
    t.add_argument("--label", default="", help="this validation's name in the page's plot (default: its date)")
    t.add_argument("--caveat", action="append", default=[], help="a sentence the page prints after the reading")
    a = ap.parse_args(argv)
    return run(a) if a.cmd == "run" else table(a)


if __name__ == "__main__":
    sys.exit(main())
