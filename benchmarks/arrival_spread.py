#!/usr/bin/env python3
"""How far issue 24's comparison moves when a workload's arrivals move a little.

    .venv/bin/python benchmarks/arrival_spread.py OUT_DIR [--stretch 0.95:1.05:0.01] [--adaptive adaptive] [--tie 0.03] \
        -- REPLAY_ARGS...

Replays the same ``aserve replay REPLAY_ARGS`` (a trace and a ``--compare`` naming vllm, sarathi
and the adaptive system) once per stretch factor, the trace's clock multiplied by it (a
``--time-scale`` in REPLAY_ARGS is multiplied, not replaced), one JSON per factor in OUT_DIR and
its printed tables beside it (.txt); a factor whose JSON is there is not run again. Then prints,
per criterion of ``benchmarks/adaptive_table.py``, adaptive's difference against the better
baseline (the P99 token gap against sarathi) in every run, their mean, spread and range, and in
how many runs it is within the tie: positive is adaptive worse. Use a ``sim:`` device: it is
deterministic, so what moves is the workload's own sensitivity to when requests arrive (where
the KV pool binds, a request that arrives a step later can wait for a whole wave of decodes),
not the machine's minutes. One run of a workload on the real device is one draw from this
spread.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaptive_table import BASELINES, CRITERIA, figures  # noqa: E402


def stretches(text: str) -> list[float]:
    """'0.95:1.05:0.01' (start:stop:step, stop included) or '0.97,1,1.03'."""
    if ":" in text:
        try:
            start, stop, step = (float(x) for x in text.split(":"))
        except ValueError:
            raise SystemExit(f"--stretch: expected START:STOP:STEP, got {text!r}")
        if step <= 0 or stop < start:
            raise SystemExit(f"--stretch: need STEP > 0 and STOP >= START, got {text!r}")
        n = int(math.floor((stop - start) / step + 1e-9)) + 1
        values = [round(start + i * step, 6) for i in range(n)]
    else:
        try:
            values = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"--stretch: expected numbers separated by commas, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise SystemExit(f"--stretch: factors must be > 0, got {text!r}")
    return values


def stretched_args(replay_args: list[str], factor: float) -> list[str]:
    """REPLAY_ARGS with the trace's clock multiplied by ``factor``."""
    args, scaled = list(replay_args), False
    for i, a in enumerate(args):
        if a == "--time-scale" and i + 1 < len(args):
            args[i + 1], scaled = repr(float(args[i + 1]) * factor), True
        elif a.startswith("--time-scale="):
            args[i], scaled = f"--time-scale={float(a.split('=', 1)[1]) * factor!r}", True
    return args if scaled else args + ["--time-scale", repr(factor)]


def differences(systems: dict, adaptive: str) -> dict[str, float]:
    """Adaptive's relative difference per criterion in one report; positive: adaptive worse."""
    missing = [n for n in (adaptive, *BASELINES) if n not in systems]
    if missing:
        raise SystemExit(f"the report has no system named {', '.join(missing)} (it has {', '.join(systems)})")
    f = {k: figures(v) for k, v in systems.items()}
    out = {}
    for label, key, ref, lower in CRITERIA:
        pick = min if lower else max
        other = f[ref][key] if ref != "best" else pick(f[b][key] for b in BASELINES)
        mine = f[adaptive][key]
        out[label] = mine / other - 1 if lower else other / mine - 1
    return out


def summary(runs: dict[float, dict[str, float]], tie: float) -> list[str]:
    factors = sorted(runs)
    lines = ["| criterion | " + " | ".join(f"x{s:g}" for s in factors) + " | mean | sd | min | max | within tie |",
             "|---|" + "---:|" * (len(factors) + 5)]
    for label, *_ in CRITERIA:
        vals = [100 * runs[s][label] for s in factors]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        lines.append(f"| {label} | " + " | ".join(f"{v:+.1f}" for v in vals)
                     + f" | {statistics.mean(vals):+.1f} | {sd:.1f} | {min(vals):+.1f} | {max(vals):+.1f} | "
                     f"{sum(v <= 100 * tie for v in vals)}/{len(vals)} |")
    return lines


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: benchmarks/arrival_spread.py OUT_DIR [options] -- REPLAY_ARGS (the replay's own flags after --)")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--stretch", default="0.95:1.05:0.01", help="factors: START:STOP:STEP or a comma list")
    p.add_argument("--adaptive", default="adaptive", help="the adaptive system's name in --compare")
    p.add_argument("--tie", type=float, default=0.03, help="a relative difference counted as a tie")
    a = p.parse_args(argv[:cut])
    replay_args = argv[cut + 1:]
    if not replay_args or any(x == "--json" or x.startswith("--json=") for x in replay_args):
        raise SystemExit("REPLAY_ARGS: give the trace and --compare; the script writes each --json itself")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        from aserve.commands import main as aserve
    except ImportError as e:
        raise SystemExit(f"aserve is not importable here ({e}): run the script with the project's Python, "
                         ".venv/bin/python benchmarks/arrival_spread.py ...")

    runs = {}
    for factor in stretches(a.stretch):
        path = out / f"stretch_{factor:g}.json"
        if not path.exists():
            log = path.with_suffix(".txt")
            print(f"arrivals x{factor:g} -> {path} (its tables: {log})", file=sys.stderr, flush=True)
            with open(log, "w") as f, contextlib.redirect_stdout(f):
                rc = aserve(["replay", *stretched_args(replay_args, factor), "--json", str(path)])
            if rc != 0:
                raise SystemExit(f"the replay at x{factor:g} failed (see {log})")
        runs[factor] = differences(json.loads(path.read_text())["systems"], a.adaptive)
    print("\n".join(summary(runs, a.tie)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
