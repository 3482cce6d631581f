"""``aserve profile device|token-budget``: measure the engine to choose settings."""
from __future__ import annotations

import argparse

from aserve.commands.common import add_engine_args


def register(subparsers) -> None:
    pr = subparsers.add_parser("profile", help="measure the engine to choose settings")
    prsub = pr.add_subparsers(dest="profile", required=True)
    pd = prsub.add_parser("device", help="this machine's step costs, taken at rest (the chunk size and token budget "
                                         "defaults come from them; a simulated device can run on them)")
    pd.add_argument("--out", default=None, help="also write the profile (JSON) here")
    pd.add_argument("--reps", type=int, default=3, help="timed steps per point, after one warm-up (median)")
    pd.add_argument("--allow-busy", action="store_true",
                    help="save the profile even where the machine was not at rest (other processes' CPU use over "
                         "0.25 cores before or during the measurement, or the probe step more than 20%% slower or "
                         "faster at the end than at the start): its meta records it and every later use warns. "
                         "Without it such a profile is refused and nothing is saved")
    g = pd.add_argument_group("calibration on replays' steps (no measuring; docs/SIMULATION.md)")
    g.add_argument("--from-steps", nargs="+", default=None, metavar="FILE",
                   help="refit the cost model on these step logs (aserve replay --step-log) and write it to --out")
    g.add_argument("--base", default=None, help="the profile refitted (and the prior of what no step touched): a "
                   "cost-model JSON, or 'local' = this machine's cached profile at --threads")
    g.add_argument("--check", nargs="+", default=None, metavar="FILE",
                   help="step logs to report the error on without fitting them (held out); with --base alone: "
                        "the base's error on them")
    g.add_argument("--ridge", type=float, default=1.0,
                   help="pull toward the base, as strong as this many steps off by 100%% (0: none)")
    g.add_argument("--target", default="forward_s", help="the logged time fitted: forward_s (the device's own "
                   "time for the step) | busy_s (as the instance's loop saw it) | cpu_s")
    g.add_argument("--systems", default=None, help="only steps of these --compare systems (comma-separated)")
    g.add_argument("--no-contention", dest="fit_contention", action="store_false",
                   help="keep the base's contention instead of fitting it")
    g.add_argument("--speed-only", action="store_true",
                   help="fit one number, the machine's speed in the logged minutes (--speed-on), and scale every "
                        "cost of the base by it")
    g.add_argument("--scale", type=float, default=None, metavar="F",
                   help="write --base with every cost times F to --out, no steps read (F > 1: a slower machine): "
                        "a sweep over the speeds a run's minutes give (docs/SIMULATION.md)")
    g.add_argument("--speed-on", default="all", choices=("all", "decode"),
                   help="--speed-only's statistic: all (default: summed measured over summed predicted time of every "
                        "step, the run's busy time) | decode (the median measured / predicted of the decode-only steps)")
    g.add_argument("--speed-window", type=float, default=None, metavar="S",
                   help="with --speed-only and one system's steps: also the speed of each S seconds of its run, "
                        "against the scaled profile (a speed trace a simulated device replays: the VM's drift)")
    add_engine_args(pd)
    pd.set_defaults(func=cmd_profile_device)
    pt = prsub.add_parser("token-budget", help="the largest Sarathi token budget whose iteration meets a TBT SLO "
                                               "(--tbt-slo, required here)")
    pt.add_argument("--decode-batch", type=int, default=32, help="running decodes in each iteration")
    pt.add_argument("--context", type=int, default=512, help="tokens of context of each decode and of the chunk")
    pt.add_argument("--tile", type=int, default=64, help="candidates and the result are multiples of this")
    pt.add_argument("--max-budget", type=int, default=4096, help="largest budget tried")
    pt.add_argument("--repeats", type=int, default=3, help="timed iterations per budget, after one warm-up")
    pt.add_argument("--no-save", action="store_true", help="do not save the budget as the sarathi default")
    add_engine_args(pt)
    pt.set_defaults(func=cmd_profile_budget)


def _engine(a: argparse.Namespace):
    """The engine as measured: the budget a run would derive does not matter here."""
    from aserve.config import EngineConfig

    return EngineConfig(model=a.model, dtype=a.dtype, device=a.device, attention=a.attention, kernels=a.kernels,
                        block_size=a.block_size, num_threads=a.threads, cache_dir=a.cache_dir, seed=a.seed,
                        allow_profile_mismatch=a.allow_profile_mismatch)


def cmd_profile_budget(a: argparse.Namespace) -> int:
    from aserve.bench.token_budget import BudgetProfile, run_budget_profile

    if not isinstance(a.tbt_slo, float):
        raise ValueError("profile token-budget needs --tbt-slo SECONDS (a number: it measures for that step time)")
    prof = BudgetProfile(a.tbt_slo, a.decode_batch, a.context, a.tile, a.max_budget, a.repeats)
    run_budget_profile(_engine(a), prof, save=not a.no_save)
    return 0


def cmd_profile_device(a: argparse.Namespace) -> int:
    import os

    from aserve.profiles.device_profile import measure_and_save

    if a.scale is not None:
        return _scale(a)
    if a.from_steps or a.check or a.base:
        return _calibrate(a)
    if a.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {a.reps}")
    measure_and_save(_engine(a), a.threads or os.cpu_count() or 1, a.reps, a.out, allow_busy=a.allow_busy)
    return 0


def _scale(a: argparse.Namespace) -> int:
    """--scale F: the base profile at another speed, every cost times F (contention, a ratio, kept)."""
    from dataclasses import replace
    from datetime import date

    from aserve.profiles.calibrate import scaled

    if not a.scale > 0:
        raise ValueError(f"--scale must be > 0 (a speed factor), got {a.scale}")
    if a.from_steps or a.check or a.speed_only:
        raise ValueError("--scale takes no steps: give it --base and --out alone (--speed-only reads the "
                         "factor off step logs instead)")
    if not a.out:
        raise ValueError("--scale needs --out FILE: where the scaled profile goes")
    base = _base_profile(a)
    out = replace(scaled(base, a.scale), meta={**base.meta, "scaled": {"by": a.scale, "date": date.today().isoformat()}})
    out.save(a.out)
    print(f"every cost x{a.scale:g} of the base's; wrote {a.out} (use it as --device sim:{a.out})")
    return 0


def _base_profile(a: argparse.Namespace):
    from aserve.profiles.cost_model import CostModel
    from aserve.profiles.device_profile import machine
    from aserve.profiles.profile_store import cost_model

    if a.base is None:
        raise ValueError("--from-steps, --check and --scale need --base: a cost-model JSON, or 'local'")
    if a.base != "local":
        return CostModel.load(a.base)
    if a.threads < 1:
        raise ValueError("--base local needs --threads: the torch threads of each replayed instance (two "
                         "instances on this machine's two cores: 1)")
    e = _engine(a)
    cost = cost_model(e.cache_dir, e.model, e.device, e.dtype, a.threads, machine())
    if cost is None:
        raise ValueError(f"no cached profile of this machine at {a.threads} thread(s): run "
                         f"'aserve profile device --threads {a.threads}' first, or give --base FILE")
    from aserve.profiles import profile_check
    from aserve.profiles.machine import cpu_flags

    for line in profile_check.load_warnings(f"this machine's profile at {a.threads} thread(s)", cost.meta, machine(),
                                            cpu_flags(), command=profile_check.measure_command(e, a.threads)):
        profile_check.warn(line)
    return cost


def _calibrate(a: argparse.Namespace) -> int:
    """--from-steps / --check: refit (or only check) a cost model on logged steps, print the
    errors before and after by step kind, write the fitted model to --out."""
    from dataclasses import replace
    from datetime import date

    from aserve.profiles.calibrate import describe, fit, scaled, speed, speed_trace, usable
    from aserve.engine.step_log import read_steps

    if a.from_steps and not a.out:
        raise ValueError("--from-steps needs --out FILE: where the fitted profile goes")
    if not (a.from_steps or a.check):
        raise ValueError("--base is for --from-steps, --check or --scale")
    if a.speed_on != "all" and not a.speed_only:
        raise ValueError("--speed-on is --speed-only's statistic: give --speed-only too")
    if a.speed_window is not None and not a.speed_only:
        raise ValueError("--speed-window is --speed-only's trace: give --speed-only too")
    base = _base_profile(a)
    systems = {s.strip() for s in a.systems.split(",")} if a.systems else None
    steps = read_steps(a.from_steps or (), a.target, systems)
    if a.speed_window is not None and (len(a.from_steps or ()) > 1 or len({s.system for s in steps}) > 1):
        raise ValueError("--speed-window reads one run's minutes: give one step log and one system of it "
                         "(--systems S)")
    checks = read_steps(a.check or (), a.target, systems)
    if not a.from_steps:
        _print_errors(describe(base, base, checks)["fitted"], "the base's error on the --check steps", ("before",))
        return 0
    factor = speed(base, steps, a.speed_on) if a.speed_only else None
    fitted = scaled(base, factor) if a.speed_only else fit(base, steps, a.ridge, fit_contention=a.fit_contention)
    if a.speed_window is not None:
        fitted = replace(fitted, speed_trace=speed_trace(fitted, steps, a.speed_window))
    record = describe(fitted, base, steps, checks)
    skipped = len(steps) - len(usable(steps))
    how = {"speed": factor, "speed_on": a.speed_on} if a.speed_only else {"ridge": a.ridge}
    if a.speed_window is not None:
        how["speed_window"] = a.speed_window
    fitted = replace(fitted, meta={**base.meta, "calibrated": {
        "from_steps": list(a.from_steps), "check": list(a.check or ()), "systems": sorted(systems or ()),
        "target": a.target, **how, "skipped_steps": skipped, "date": date.today().isoformat(), **record}})
    fitted.save(a.out)
    if a.speed_only:
        print(f"speed in the logged minutes: every cost x{factor:.3f} of the base's")
        if fitted.speed_trace:
            factors = [f for _, f in fitted.speed_trace]
            print(f"speed trace: {len(factors)} windows of {a.speed_window:g} s, x{min(factors):.3f} to "
                  f"x{max(factors):.3f} of that (a simulated device multiplies each step by its window's factor)")
    else:
        _print_fit(base, fitted, skipped)
    held = sum(s.seconds for s in read_steps(a.from_steps, "busy_s", systems))
    forward = sum(s.seconds for s in read_steps(a.from_steps, "forward_s", systems))
    if forward > 0:
        print(f"the logged steps held their instances {held / forward - 1:+.1%} longer than their forward "
              f"(busy_s over forward_s: the hand-off to the device thread and the loop's wait to resume); "
              f"fitted: {a.target}")
    _print_errors(record["fitted"], "error on the steps fitted (|pred - real| / real)")
    if checks:
        _print_errors(record["check"], "error on the held-out --check steps")
    print(f"wrote {a.out} (use it as --device sim:{a.out})")
    return 0


def _print_fit(base, fitted, skipped: int) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="linear table, base -> fitted")
    for col in ("rows", "base ms", "fitted ms", "change"):
        t.add_column(col, justify="right")
    for n, y in zip(fitted.tokens, fitted.linear_s):
        b = base.linear(n)
        t.add_row(str(n), f"{b * 1e3:.2f}", f"{y * 1e3:.2f}", f"{y / b - 1:+.1%}" if b > 0 else "")
    console = Console()
    console.print(t)
    console.print(f"attention: {base.attn_prefill_s * 1e9:.3f} -> {fitted.attn_prefill_s * 1e9:.3f} ns a prompt pair, "
                  f"{base.attn_decode_s * 1e9:.2f} -> {fitted.attn_decode_s * 1e9:.2f} ns a decode context token; "
                  f"logits {base.logits_row_s * 1e3:.3f} -> {fitted.logits_row_s * 1e3:.3f} ms a row; contention "
                  f"{base.contention:+.1%} -> {fitted.contention:+.1%}"
                  + (f"; {skipped} steps skipped (empty, untimed or swapping)" if skipped else ""), highlight=False)


def _print_errors(record: dict, title: str, phases=("before", "after")) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    t.add_column("steps")
    t.add_column("n", justify="right")
    for phase in phases:
        for col in ("median", "P90", "sum"):
            t.add_column(f"{col} {phase}" if len(phases) > 1 else col, justify="right")
    for kind, first in record[phases[0]].items():
        cells = []
        for phase in phases:
            e = record[phase][kind]
            cells += [f"{e['median']:.1%}", f"{e['p90']:.1%}", f"{e['total']:+.1%}"]
        t.add_row(kind, str(first["steps"]), *cells)
    Console().print(t)
