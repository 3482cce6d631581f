#!/usr/bin/env python3
"""Issue 62 at paper scale: each system with and without the prefix cache on a multi-turn workload.

    python benchmarks/prefix_cache_sim.py run OUT_DIR [--requests 256] [--systems vllm,sarathi,...]
    python benchmarks/prefix_cache_sim.py table OUT_DIR [--json results/prefix_cache_sim.json]
    python benchmarks/prefix_cache_sim.py run OUT_DIR --cpu ...; ... table OUT_DIR --cpu [--json results/prefix_cache_cpu.json]

``--cpu``: the same steps on this machine's CPU (real time: nothing else may run), two instances of one
thread and 0.5 GiB of KV each per system (vllm and sarathi as 2 coupled instances, tetri 1P+1D, adaptive
starting 1P+1D), as the real-CPU goodput rows run: the first ``--cpu-requests`` (32) requests, lengths
x``--cpu-length-scale`` (0.1), each search's knee to ``--cpu-precision`` (0.25); the pressure step cuts
each instance's pool to ``--cpu-pressure-gb`` (0.02; replays only: no pressure searches). Without the
``replay`` step (``--steps goodput,pressure``, to fit an hour) the table gives each way's hit rate, TTFT
and KV moved at its own knee.

Four simulated V100s a system (``sim:opt-13b-v100-32gb``, OPT-13B): vllm and sarathi as four coupled
instances, tetri 2P+2D (and 1P+3D), adaptive starting 2P+2D. Each system runs three ways: the cache on
with the placement that counts cached prefixes (the default), the cache on with least-loaded placement
(``-noplace``: the placement's gain over caching alone), the cache off (``-nocache``). ``run`` does, on
``aserve workload Chat`` (multi-turn conversations over four shared system prompts):

1. ``bench goodput`` at the balanced corner, one search per system and way (OUT/goodput_SYSTEM.json);
2. one ``replay`` of every system and way at a fixed rate below every knee (OUT/replay.json): hit
   rate, TTFT, KV bytes moved between instances (the links' charge), evictions;
3. the same replay on a V100 whose KV pool is cut to ``--pressure-kv-tokens`` (a profile file with a
   larger reserve, the step costs unchanged: OUT/pressure.json), so the cache must evict: does
   caching ever lose to no caching there?

A step whose output exists is not run again (a cut-off run resumes). Everything runs on virtual time
(any machine; about a minute a search of 256 requests on two shared cores). ``table`` prints the
tables and writes the small result file docs/RESULTS.md renders (scripts/results_page.py,
``render_prefix_cache``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "sim:opt-13b-v100-32gb"
PROFILE = ROOT / "aserve" / "profiles" / "sim_profiles" / "opt-13b-v100-32gb.json"
SYSTEMS = {"vllm": "--mode coupled --instances 4 --batching vllm",
           "sarathi": "--mode coupled --instances 4 --batching sarathi",
           "tetri-2p2d": "--mode disagg --prefill 2 --decode 2",
           "tetri-1p3d": "--mode disagg --prefill 1 --decode 3",
           "adaptive": "--mode adaptive --prefill 2 --decode 2"}
CPU_SYSTEMS = {"vllm": "--mode coupled --instances 2 --batching vllm",
               "sarathi": "--mode coupled --instances 2 --batching sarathi",
               "tetri": "--mode disagg --prefill 1 --decode 1",
               "adaptive": "--mode adaptive --prefill 1 --decode 1"}
CPU_DEVICE = ["--device", "cpu", "--threads", "2"]
CPU_KV_GB = 0.5
KV_BYTES_CPU = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M's KV a token in fp32: 30 layers, K and V, 3 heads of 64
WAYS = {"": "", "-noplace": " --no-prefix-aware-placement", "-nocache": " --no-enable-prefix-caching"}
CORNER = "balanced"


def compare(systems, table: dict = SYSTEMS) -> str:
    return " ; ".join(f"{s}{w}: {table[s]}{flags}" for s in systems for w, flags in WAYS.items())


def cli(args: list, log: Path) -> float:
    """``python cli.py ARGS`` with its output in LOG; wall seconds (a failure is printed, not fatal:
    the next run repeats a step whose output is missing)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "cli.py", *map(str, args)], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    print(f"  {wall:6.0f} s  {' '.join(map(str, args))[:150]}", flush=True)
    if rc:  # a replay exits 1 when a request failed: its JSON is still written and read
        print(f"  exit {rc}: see {log}", flush=True)
    return wall


TOKEN_BYTES = 819_200  # OPT-13B's KV a token in fp16


def kv_bytes(data: dict) -> int:
    """The KV pool a profile file leaves (aserve/devices/sim_device.py, hardware_cost)."""
    hw, eff = data["hardware"], data["efficiency"]
    return int(hw["memory_bytes"] * eff["memory_usable"] - data["num_params"] * data["dtype_bytes"]
               - eff["activation_reserve_bytes"])


def pressure_profile(out: Path, kv_tokens: int) -> Path:
    """The V100 profile with its KV pool cut to ``kv_tokens`` of OPT-13B by a larger activation
    reserve: the same step costs, less room."""
    data = json.loads(PROFILE.read_text())
    kv_now = kv_bytes(data)
    data["efficiency"]["activation_reserve_bytes"] += kv_now - kv_tokens * TOKEN_BYTES
    data["name"] = f"opt-13b-v100-32gb-kv{kv_tokens}"
    data["about"] = (f"{data['name']}: the V100 profile (OPT-13B) with {kv_now // TOKEN_BYTES:,} tokens of KV cut to "
                     f"{kv_tokens:,} (a larger reserve; step costs unchanged): a prefix cache under memory pressure")
    path = out / f"{data['name']}.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def replay_rate(out: Path, systems, share: float) -> float:
    """``share`` of the lowest knee any searched system reached (req/s for four devices)."""
    knees = [s["knee_rate"] for name in systems if (out / f"goodput_{name}.json").exists()
             for s in json.loads((out / f"goodput_{name}.json").read_text())["systems"].values() if s["knee_rate"]]
    if not knees:
        raise SystemExit("no knee found in OUT/goodput_*.json: give --replay-rate")
    return float(f"{share * min(knees):.2g}")


def run(a: argparse.Namespace) -> int:
    out = Path(a.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    systems = a.systems.split(",")
    trace = out / "chat.jsonl"
    walls = json.loads((out / "walls.json").read_text()) if (out / "walls.json").exists() else {}

    def step(key: str, args: list, done: Path) -> None:
        if not done.exists():
            walls[key] = cli(args, out / f"{key}.log")
            (out / "walls.json").write_text(json.dumps(walls, indent=1))

    step("workload", ["workload", "Chat", "--num-requests", a.requests, "--rate", a.rate, "--seed", a.seed,
                      "--out", trace] + (["--lengths", a.lengths] if a.lengths else []), trace)
    if a.cpu:
        return run_cpu(a, out, systems, trace, step)
    if "goodput" in a.steps:
        for s in systems:
            step(f"goodput_{s}", ["bench", "goodput", trace, "--device", DEVICE, "--slo", CORNER, "--compare",
                                  compare([s]), "--json", out / f"goodput_{s}.json", "--no-progress"],
                 out / f"goodput_{s}.json")
    rate = a.replay_rate or replay_rate(out, systems, a.replay_share)
    prof = pressure_profile(out, a.pressure_kv_tokens)
    (out / "params.json").write_text(json.dumps({"replay_rate": rate, "pressure_kv_tokens": a.pressure_kv_tokens,
                                                 "pressure_profile": prof.name}, indent=1))
    if "replay" in a.steps:
        step("replay", ["replay", trace, "--rate", rate, "--device", DEVICE, "--slo", CORNER, "--compare",
                        compare(systems), "--json", out / "replay.json", "--no-progress"], out / "replay.json")
    if "pressure" in a.steps:
        step("pressure", ["replay", trace, "--rate", rate, "--device", f"sim:{prof}", "--slo", CORNER, "--compare",
                          compare(systems), "--json", out / "pressure.json", "--no-progress"], out / "pressure.json")
    if "pressure-goodput" in a.steps:  # the searches again on the small pool
        for s in systems:
            step(f"pressure_goodput_{s}", ["bench", "goodput", trace, "--device", f"sim:{prof}", "--slo", CORNER,
                                           "--compare", compare([s]), "--json", out / f"pgoodput_{s}.json",
                                           "--no-progress"], out / f"pgoodput_{s}.json")
    return 0


def run_cpu(a: argparse.Namespace, out: Path, systems, trace: Path, step) -> int:
    """``run --cpu``: the searches and replays on this CPU (real time), the trace shrunk to fit."""
    shrink = ["--num-requests", a.cpu_requests, "--length-scale", a.cpu_length_scale]
    kv = ["--kv-cache-gb", CPU_KV_GB]
    if "goodput" in a.steps:
        for s in systems:
            step(f"goodput_{s}", ["bench", "goodput", trace, *shrink, "--precision", a.cpu_precision, *CPU_DEVICE, *kv,
                                  "--slo", CORNER, "--compare", compare([s], CPU_SYSTEMS),
                                  "--json", out / f"goodput_{s}.json", "--no-progress"], out / f"goodput_{s}.json")
    rate = a.replay_rate or replay_rate(out, systems, a.replay_share)
    (out / "params.json").write_text(json.dumps({"replay_rate": rate, "kv_gb": CPU_KV_GB, "pressure_kv_gb": a.cpu_pressure_gb,
                                                 "num_requests": a.cpu_requests, "length_scale": a.cpu_length_scale,
                                                 "precision": a.cpu_precision}, indent=1))
    for key, gb in (("pressure", a.cpu_pressure_gb), ("replay", CPU_KV_GB)):
        if key in a.steps:
            step(key, ["replay", trace, *shrink, "--rate", rate, *CPU_DEVICE, "--kv-cache-gb", gb, "--slo", CORNER,
                       "--compare", compare(systems, CPU_SYSTEMS), "--json", out / f"{key}.json", "--no-progress"],
                 out / f"{key}.json")
    return 0


# ---- the table -----------------------------------------------------------------------------------
def replay_rows(report: dict) -> dict:
    """Per system and way: the figures the issue asks for, from a replay's JSON."""
    rows = {}
    for name, s in report["systems"].items():
        rows[name] = {"hit_rate": s["prefix_cache_hit_rate"], "ttft_mean_s": s["ttft"]["mean"],
                      "ttft_p50_s": s["ttft"]["p50"], "ttft_p99_s": s["ttft"]["p99"], "jct_mean_s": s["jct"]["mean"],
                      "queue_p90_s": s["queue_time"] and s["queue_time"]["p90"],
                      "kv_bytes_moved": s["kv_bytes_charged"], "kv_transfers": s["kv_transfers"],
                      "evictions": s["prefix_cache_evictions"], "preemptions": s["preemptions"],
                      "attainment": s["slo_attainment"], "busy_s": s["resource_usage_s"],
                      "completed": s["completed"], "failed": s["failed"]}
    return rows


def goodput_rows(runs: dict) -> dict:
    rows = {}
    for run in runs.values():
        for name, s in run["systems"].items():
            knee = next((p for p in s["points_detail"] if p["rate"] == s["knee_rate"]), None)
            rows[name] = {"goodput_per_device": s["goodput_per_device"], "knee_rate": s["knee_rate"],
                          "knee_bracket": s["knee_bracket"], "bound": s["bound"], "limited_by": s["limited_by"],
                          "num_points": s["num_points"], "wall_s": round(s["wall_s"], 1), "predictor": s["predictor"],
                          "ttft_mean_at_knee": knee and knee.get("ttft_mean_s"),
                          "ttft_p99_at_knee": knee and knee.get("ttft_p99_s"),
                          "hit_rate_at_knee": knee and knee.get("prefix_cache_hit_rate"),
                          "kv_bytes_moved_at_knee": knee and knee.get("kv_bytes_moved"),
                          "evictions_at_knee": knee and knee.get("prefix_cache_evictions")}
    return rows


def fmt(x, f="{:.3f}") -> str:
    return "-" if x is None else f.format(x)


def markdown(systems: list, good: dict, pgood: dict, replay: dict, pressure: dict) -> str:
    lines = ["| system | way | goodput req/s a device | hit rate | mean TTFT s | P99 TTFT s | KV moved GB | "
             "evictions | preemptions | small pool: goodput | hit rate | mean TTFT s | evictions | preemptions |",
             "|---|---|" + "---:|" * 12]
    for s in systems:
        for w in WAYS:
            n = s + w
            g, r, p = good.get(n, {}), replay.get(n, {}), pressure.get(n, {})
            kv = r.get("kv_bytes_moved")
            lines.append(f"| {s} | {w.lstrip('-') or 'cache + placement'} | {fmt(g.get('goodput_per_device'))} | "
                         f"{fmt(r.get('hit_rate'), '{:.1%}')} | {fmt(r.get('ttft_mean_s'))} | {fmt(r.get('ttft_p99_s'))} | "
                         f"{fmt(None if kv is None else kv / 1e9, '{:.3f}')} | "
                         f"{fmt(r.get('evictions'), '{:,d}')} | {fmt(r.get('preemptions'), '{:d}')} | "
                         f"{fmt(pgood.get(n, {}).get('goodput_per_device'))} | "
                         f"{fmt(p.get('hit_rate'), '{:.1%}')} | {fmt(p.get('ttft_mean_s'))} | "
                         f"{fmt(p.get('evictions'), '{:,d}')} | {fmt(p.get('preemptions'), '{:d}')} |")
    return "\n".join(lines)


def table(a: argparse.Namespace) -> int:
    out = Path(a.out_dir)

    def read(name: str):
        return json.loads((out / name).read_text()) if (out / name).exists() else None

    runs = {p.stem.removeprefix("goodput_"): json.loads(p.read_text()) for p in sorted(out.glob("goodput_*.json"))}
    pruns = {p.stem.removeprefix("pgoodput_"): json.loads(p.read_text()) for p in sorted(out.glob("pgoodput_*.json"))}
    rep, pres, walls, params = read("replay.json"), read("pressure.json"), read("walls.json") or {}, read("params.json") or {}
    names = CPU_SYSTEMS if a.cpu else SYSTEMS
    systems = [s for s in names if s in runs or any(n.startswith(s) for n in (rep or {}).get("systems", {}))]
    good, pgood = goodput_rows(runs), goodput_rows(pruns)
    replay, pressure = (replay_rows(rep) if rep else {}), (replay_rows(pres) if pres else {})
    at_knee = a.cpu and not rep  # --cpu without its replay step: each way's figures at its own knee
    if at_knee:
        replay = {n: {"hit_rate": g["hit_rate_at_knee"], "ttft_mean_s": g["ttft_mean_at_knee"],
                      "ttft_p99_s": g["ttft_p99_at_knee"], "kv_bytes_moved": g["kv_bytes_moved_at_knee"],
                      "evictions": g["evictions_at_knee"], "preemptions": None} for n, g in good.items()}
    print(markdown(systems, good, pgood, replay, pressure))
    if not a.json:
        return 0
    trace = next(iter(runs.values()))["trace"] if runs else (rep or pres)["trace"]
    first = next(iter(runs.values()), {})
    abouts = sorted({(r["about"]["commit"], r["about"]["date"][:10], r["about"]["machine"])
                     for r in (*runs.values(), *pruns.values())})
    if a.cpu:
        kv_tokens = int(params["kv_gb"] * 2**30 // KV_BYTES_CPU)
        pressure_tokens = int(params["pressure_kv_gb"] * 2**30 // KV_BYTES_CPU)
    else:
        kv_tokens, pressure_tokens = kv_bytes(json.loads(PROFILE.read_text())) // TOKEN_BYTES, params.get("pressure_kv_tokens")
    data = {"device": "cpu" if a.cpu else DEVICE, "devices_per_system": 2 if a.cpu else 4, "corner": CORNER,
            "device_words": ("two CPU instances of one thread (SmolLM2-135M, fp32)" if a.cpu
                             else "four simulated V100s (OPT-13B)"),
            "device_unit": "an instance" if a.cpu else "a V100", "kv_unit": "MB" if a.cpu else "GB", "systems": systems,
            "ways": {w.lstrip("-") or "cache": flags.strip() or "(the defaults: cache on, prefix-aware placement)"
                     for w, flags in WAYS.items()},
            "workload": {"source": "aserve workload Chat", "num_requests": trace["num_requests"],
                         "duration_s": trace.get("duration_s"), "native_rate": trace.get("native_rate"),
                         "mean_prompt_tokens": trace["prompt_tokens"] / trace["num_requests"],
                         "mean_output_tokens": trace["output_tokens"] / trace["num_requests"]},
            "slo": first.get("slo", {}).get("line"),
            "goodput": good,
            "replay": {"rate": None if at_knee else params.get("replay_rate"), "at_knee": at_knee,
                       "kv_tokens": kv_tokens, "systems": replay},
            "pressure": {"rate": params.get("replay_rate"), "kv_tokens": pressure_tokens,
                         "goodput": pgood, "systems": pressure}}
    if a.caveat:
        data["caveats"] = a.caveat
    if a.cpu:
        data["workload"].update(shrunk={k: params[k] for k in ("num_requests", "length_scale", "precision")})
    searches = len(runs) + len(pruns)
    cpu_flags = (f" --cpu --cpu-requests {params.get('num_requests')} --cpu-length-scale {params.get('length_scale')}"
                 f" --cpu-precision {params.get('precision')} --cpu-pressure-gb {params.get('pressure_kv_gb')}") if a.cpu else ""
    result = {"meta": {
        "order": 35, "kind": "prefix_cache", "title": "Prefix caching at paper scale",
        "question": "On multi-turn conversations (four V100s a system, OPT-13B, simulated), what does each system "
                    "gain from the prefix cache and from placing a prompt where its prefix lives, and does a cache "
                    "that must evict ever lose to none?",
        "machine": "; ".join(sorted({m for _, _, m in abouts})) or "n/a",
        "commit": ", ".join(sorted({c for c, _, _ in abouts})) or "n/a",
        "date": ", ".join(sorted({d for _, d, _ in abouts})) or "n/a",
        "command": "python benchmarks/prefix_cache_sim.py run OUT"
                   + ("" if a.cpu else f" --requests {trace['num_requests']}") + f" --systems {','.join(systems)}" + (" --steps goodput,replay,pressure,pressure-goodput" if pruns else "")
                   + cpu_flags + f" && python benchmarks/prefix_cache_sim.py table OUT{' --cpu' if a.cpu else ''} --json {a.json}"
                   + "".join(" --caveat '...'" for _ in a.caveat),
        "wall_time": f"{sum(walls.values()) / 60:.0f} min ({searches} goodput searches of {len(WAYS)} ways each, "
                     f"two replays of {len(replay)} systems, " + ("real time, nothing else running)" if a.cpu else "virtual time)"),
        "notes": "docs/notes/prefix_cache.md", "source": "Paper scale: goodput, KV moved and eviction (sim)"},
        "data": data}
    if a.cpu:
        result["meta"].update(
            order=36, title="Prefix caching on this CPU",
            question="On multi-turn conversations on this machine's CPU (two instances a system), what does each "
                     "system gain from the prefix cache and from prefix-aware placement, and does a cache that must "
                     "evict ever lose to none?",
            source="The real CPU: goodput, KV moved and eviction")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {a.json}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the workload, the searches, the replays (resumable)")
    r.add_argument("out_dir")
    r.add_argument("--requests", type=int, default=256, help="Chat requests (default 256)")
    r.add_argument("--rate", type=float, default=1.0, help="the workload's own mean rate, req/s")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--lengths", default=None, help="the ShareGPT length table (default: aserve workload's, the "
                   "shared data copy beside the repository)")
    r.add_argument("--systems", default="vllm,sarathi,tetri-2p2d,adaptive",
                   help=f"comma-separated, of {', '.join(SYSTEMS)}")
    r.add_argument("--steps", default="goodput,replay,pressure",
                   help="which of goodput,replay,pressure,pressure-goodput to run (the last: the searches again on "
                        "the small pool)")
    r.add_argument("--replay-rate", type=float, default=None,
                   help="req/s of the replays (default: --replay-share of the lowest knee)")
    r.add_argument("--replay-share", type=float, default=0.75)
    r.add_argument("--pressure-kv-tokens", type=int, default=2560,
                   help="KV tokens a V100 holds under pressure (default 2,560: half the profile's 5,065)")
    r.set_defaults(func=run)
    r.add_argument("--cpu", action="store_true", help="on this machine's CPU, real time (module doc)")
    r.add_argument("--cpu-requests", type=int, default=32, help="--cpu: the first N requests (default 32)")
    r.add_argument("--cpu-length-scale", type=float, default=0.1, help="--cpu: lengths x this (default 0.1)")
    r.add_argument("--cpu-precision", type=float, default=0.25, help="--cpu: each knee's relative step (default 0.25)")
    r.add_argument("--cpu-pressure-gb", type=float, default=0.02,
                   help="--cpu: KV GiB an instance under pressure (default 0.02: about 470 tokens of SmolLM2, "
                        "two or three of the shrunk conversations' requests)")
    t = sub.add_parser("table", help="print the tables; --json: write the result file")
    t.add_argument("out_dir")
    t.add_argument("--cpu", action="store_true", help="the runs of run --cpu")
    t.add_argument("--caveat", action="append", default=[], help="a sentence the results page prints after the "
                   "reading (e.g. what the run-to-run spread is); repeatable")
    t.add_argument("--json", default=None)
    t.set_defaults(func=table)
    a = p.parse_args(argv)
    names = CPU_SYSTEMS if a.cpu else SYSTEMS
    if a.cmd == "run" and a.cpu and a.systems == r.get_default("systems"):
        a.systems = ",".join(CPU_SYSTEMS)
    if a.cmd == "run" and not set(a.systems.split(",")) <= set(names):
        p.error(f"--systems: each of {', '.join(names)}")
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
