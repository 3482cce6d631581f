"""``aserve bench goodput``: flags -> trace, systems, SLO -> every system's search -> table, JSON, plot.

    aserve bench goodput TRACE --slo CORNER|KEY=S,... [--goodput KEY:MS ...] [--compare 'A: flags ; B: flags']
                         [--target 0.9] [--precision 0.05] [--max-points 12] [--rate-start R] [--repeats K]
                         [--json FILE] [--plot FILE] [--estimate-only] [fit, engine and cluster flags]

The search is aserve/bench/goodput.py; the run, with progress and a real device's estimate,
aserve/bench/goodput_run.py; the output aserve/bench/goodput_report.py.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from aserve.commands.common import bundle_engine
from aserve.commands.replay import build_specs, compare_items, driver_computes, fit_options, predictor_lines
from aserve.commands.slo_args import slo_from_args


def _check(a: argparse.Namespace) -> None:
    if a.rate is not None:
        raise ValueError("--rate is what bench goodput searches: use --rate-start for its first point")
    if a.time_scale != 1.0:
        raise ValueError("--time-scale re-times the trace, which the search does at each point: leave it out")
    if not a.slo and not a.goodput:
        raise ValueError("bench goodput needs an SLO: --slo balanced | tight-ttft | tight-tpot, or --goodput "
                         "KEY:MS ... (e.g. --goodput ttft:250 tpot:100)")
    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (replays of each probed rate), got {a.repeats}")
    if a.rate_start is not None and not a.rate_start > 0:
        raise ValueError(f"--rate-start must be > 0 req/s, got {a.rate_start}")


def budget_line(spec) -> str:
    """A system's token budget and what sized it (the SLO in force, a --tbt-slo, or the device's rule)."""
    e, c = spec.engine, spec.cluster
    if e.batching == "vllm" and c.mode == "coupled" or c.mode == "disagg":
        return f"token budget {e.max_num_batched_tokens} (no chunked steps beside decodes to size)"
    line = f"token budget {e.max_num_batched_tokens}" + (
        f" (steps <= {e.tbt_slo * 1000:.0f} ms)" if e.tbt_slo else " (the device's rule: 5x a 32-decode step)")
    if c.mode == "adaptive" and c.prefill_token_budget:
        line += f", prefill instances {c.prefill_token_budget} (steps <= {c.prefill_tbt_slo * 1000:.0f} ms)"
    if c.mode == "adaptive" and c.slo_placement:
        line += f", placement by TTFT slack {c.placement_slack:g}"
    if c.mode == "adaptive" and c.tpot_slo is not None:
        line += (", prompts kept from decodes they would push past TPOT, decodes handed over where prompts"
                 " would push them past it")
    if c.mode == "adaptive" and c.slo_order:
        line += ", prompts by TTFT deadline"
    return line


def run_goodput_command(a: argparse.Namespace) -> int:
    from rich.console import Console

    from aserve.bench.about import about
    from aserve.bench.goodput_report import plot_attainment, print_table, system_json, write_json
    from aserve.bench.goodput_run import GoodputJob, budget_hints, devices, native_rate, prepare, run_systems
    from aserve.devices.factory import is_sim, load_bundle
    from aserve.devices.virtual_time import run_virtual
    from aserve.event_loop import run as run_loop
    from aserve.replay.report import predictor_label
    from aserve.replay.trace_formats import read_trace
    from aserve.replay.traces import fit
    from aserve.replay.workloads import PromptBuilder

    _check(a)
    items = compare_items(a.compare, a) if a.compare else [(a.name, a)]
    slo = slo_from_args(a, items[0][1])
    if not slo.relative:  # the floor, ceiling and the check that the SLO can be met read the device's costs
        from aserve.commands.slo_args import device_costs

        slo = replace(slo, costs=device_costs(items[0][1]))
    import sys

    console = Console(log_path=False) if sys.stdout.isatty() else Console(width=150, log_path=False)  # logs: no wrapping
    bundle = load_bundle(bundle_engine(a), driver_computes(items))
    context = bundle.args.max_position
    raw = read_trace(a.trace, lambda text: len(bundle.tokenizer.encode(text, add_special_tokens=False)))

    def fitted(rate):  # the same requests, re-timed (None: the trace's own arrivals)
        return fit(raw, fit_options(a, context, rate=rate, time_scale=1.0), str(a.trace))

    first = fitted(None)
    specs = build_specs(items, first.longest_context, slo)
    for line in predictor_lines(items):
        console.print(line, highlight=False)
    sim = is_sim(specs[0].engine)
    if len({is_sim(s.engine) for s in specs}) > 1:
        raise ValueError("--compare mixes simulated and real devices: search them separately")
    if sim and a.repeats > 1:
        raise ValueError(f"--repeats {a.repeats}: a simulated device ({specs[0].engine.device}) replays a rate the same "
                         "way every time (virtual time), so one replay is all of them; leave --repeats out")
    prompts = PromptBuilder(bundle.tokenizer, Path(a.prompts) if a.prompts else None, a.seed).build(first.requests)
    twin = a.estimate_device or (None if sim or not a.device.startswith("cpu") else "sim:local")
    if twin is not None and not twin.startswith("sim:"):
        raise ValueError(f"--estimate-device must be a simulated device (sim:PROFILE), got {twin!r}")
    job = GoodputJob(fitted, prompts, bundle, slo, a.target, a.precision, a.max_points, a.rate_start,
                     run_virtual if sim else run_loop, twin, a.timeout, a.progress, a.repeats)
    requests = prepare(job, a.trace)
    console.print(slo.describe(requests), highlight=False)
    for spec in specs:
        console.print(f"{spec.name}: {budget_line(spec)}", highlight=False)
    for hint in budget_hints(specs, slo, requests):
        console.print(f"[yellow]note[/yellow] {hint}", highlight=False)
    if a.estimate_only:
        if job.estimate_device is None:
            raise ValueError("--estimate-only is for a real CPU device, or with --estimate-device sim:PROFILE (a sim: "
                             "search takes seconds; a GPU's search has no simulated twin by default)")
        from aserve.bench.goodput_run import estimate

        for spec in specs:
            knee, wall = estimate(job, spec, requests, console)
            console.print(f"{spec.name}: estimated wall time {wall / 60:.1f} min"
                          + (f" (knee near {knee.rate:.3g} req/s on {job.estimate_device})" if knee and knee.rate else ""))
        return 0
    results = run_systems(job, specs, requests, console)
    systems = {}
    for spec in specs:
        knee, wall, est, sim_rate = results[spec.name]
        label = predictor_label({"predictor": {"name": spec.cluster.predictor},
                                 "config": {"cluster": {"predictor_options": spec.cluster.predictor_options}}})
        systems[spec.name] = {**system_json(spec, knee, devices(spec), wall, est, label),
                              "estimated_knee_rate": sim_rate, "estimate_device": job.estimate_device}
    report = {"about": about(getattr(a, "argv", None)), "trace": {**first.summary(), "native_rate": native_rate(first.requests)},
              "slo": {**slo.to_json(requests), "line": slo.describe(requests)},
              "search": {"target": a.target, "precision": a.precision, "max_points": a.max_points,
                         "rate_start": a.rate_start, "device": a.device, "repeats": a.repeats}, "systems": systems}
    print_table(report, console)
    if a.json:
        console.print(f"wrote {write_json(report, a.json)}")
    if a.plot:
        console.print(f"wrote {plot_attainment(report, a.plot)}")
    return 0
