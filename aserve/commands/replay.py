"""``aserve replay`` and ``aserve workload``: argparse -> frozen configs -> replay -> report.

    aserve replay TRACE [fit flags] [--prompts FILE] [--compare 'A: flags ; B: flags']
                        [--json FILE] [--plots DIR] [--slo CORNER | --goodput ttft:MS tpot:MS ...]
                        [engine and cluster flags]
    aserve bench serve --url URL TRACE [the same flags]   (load against a running server, as
                        'vllm bench serve'; the old spelling 'aserve replay TRACE --url URL' still
                        works and prints a note)
    aserve workload NAME [--num-requests 128] [--out traces/NAME.jsonl] [--rate 1.0]

``--compare`` items are parsed with the same engine and cluster flags (add_engine_args,
add_cluster_args) on top of the command line's own values; flags that change the model
bundle (model, dtype, device, attention, kernels, cache dir) may not differ between systems, since the
bundle is loaded once and shared.
"""
from __future__ import annotations

import argparse
import copy
import shlex
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Optional

from aserve.commands.common import add_cluster_args, add_engine_args, bundle_engine, engine_and_cluster
from aserve.commands.slo_args import add_slo_args, slo_from_args
from aserve.event_loop import run as run_loop

BUNDLE_FLAGS = ("model", "dtype", "device", "attention", "kernels", "cache_dir")


def _system_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="--compare item", add_help=False, exit_on_error=False)
    add_engine_args(p)
    add_cluster_args(p)
    return p


def parse_compare(text: str, base: argparse.Namespace, context: Optional[int] = None) -> list:
    """``'NAME: flags ; NAME: flags'`` -> SystemSpecs, each over a copy of the command line's values;
    ``context``: the longest prompt + output of the trace (the derived token budgets hold at it)."""
    return build_specs(compare_items(text, base), context)


def build_specs(items: list, context: Optional[int] = None, slo=None) -> list:
    """``(name, namespace)`` pairs -> SystemSpecs (a None name: the system's default name);
    ``slo``: the SLO in force, which sizes chunked systems' token budgets (``--tbt-slo``)."""
    from aserve.replay.driver import SystemSpec, default_name

    specs = []
    for name, ns in items:
        engine, cluster = engine_and_cluster(ns, context, slo)
        specs.append(SystemSpec(name or default_name(engine, cluster), engine, cluster))
    return specs


def compare_items(text: str, base: argparse.Namespace) -> list:
    """Check ``--compare`` at once (before any model is loaded): ``(name, namespace)`` pairs."""
    items = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, sep, flags = item.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"bad --compare item {item!r}: use 'NAME: flags'")
        ns = copy.copy(base)
        try:
            ns, extra = _system_parser().parse_known_args(shlex.split(flags), namespace=ns)
        except argparse.ArgumentError as e:
            raise ValueError(f"--compare {name.strip()}: {e}") from None
        if extra:
            raise ValueError(f"--compare {name.strip()}: unknown flags {' '.join(extra)}")
        changed = [f for f in BUNDLE_FLAGS if getattr(ns, f) != getattr(base, f)]
        if changed:
            raise ValueError(f"--compare {name.strip()}: {', '.join(changed)} cannot differ between systems "
                             "(one model bundle is shared)")
        items.append((name.strip(), ns))
    if len({name for name, _ in items}) != len(items):
        raise ValueError("--compare names must be distinct")
    if not items:
        raise ValueError("--compare has no systems")
    return items


def predictor_lines(items: list) -> list[str]:
    """One line per distinct choice among ``(name, flags)`` systems: which predictor and why."""
    from aserve.commands.common import parse_options
    from aserve.commands.serve_predictor import default_predictor

    lines: dict[str, list[str]] = {}
    for name, ns in items:
        backend, options, why = default_predictor(ns, parse_options(ns.predictor_option, "predictor-option"))
        label = f"{backend} {float(options['accuracy']):.1%}" if backend == "accuracy" else backend
        lines.setdefault(f"predictor {label} ({why})", []).append(name or "the system")
    return [f"{', '.join(names)}: {line}" for line, names in lines.items()]


def add_fit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace fitting")
    g.add_argument("--num-requests", type=int, default=None, help="replay only the first N requests")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (0.5 = twice as fast)")
    g.add_argument("--rate", type=float, default=None,
                   help="req/s: rescale a timed trace to this mean rate, or draw arrivals for an untimed one")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of drawn inter-arrival times (1 = Poisson, < 1 burstier)")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="clip prompts to this length")
    g.add_argument("--max-output-tokens", type=int, default=None, help="clip outputs to this length")
    g.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and output lengths")


def fit_options(a: argparse.Namespace, context: int, **override):
    """The fit flags of ``a`` as ``FitOptions`` for a model of ``context`` tokens; ``override``
    replaces fields (``bench capacity`` sets the rate it probes)."""
    from dataclasses import replace

    from aserve.replay.traces import FitOptions

    opts = FitOptions(a.num_requests, a.time_scale, a.rate, a.burstiness, a.max_prompt_tokens, a.max_output_tokens,
                      a.length_scale, context, a.seed)
    return replace(opts, **override)


URL_NOTE = "aserve: note: 'aserve bench serve --url URL TRACE' is the new spelling of 'aserve replay TRACE --url URL'"


def add_replay_args(r: argparse.ArgumentParser, url_required: bool = False) -> None:
    """Every flag of ``aserve replay``; ``aserve bench serve`` is this parser with ``--url`` required."""
    r.add_argument("trace", help="Azure CSV, lengths CSV, Mooncake JSONL or aserve JSONL (auto-detected)")
    r.add_argument("--prompts", default=None, help="JSONL with 'prompt' text: real prompts cut/extended to length "
                   "(default: random token ids)")
    r.add_argument("--chat", action="store_true", help="send each request's text (the trace's own) as one chat "
                   "turn with the model's chat template, as a chat client does; its length is the template's")
    r.add_argument("--url", "--base-url", dest="url", required=url_required, default=None,
                   help="the OpenAI-compatible server to load" if url_required else
                   "replay against this OpenAI-compatible server instead of in-process (new spelling: "
                   "'aserve bench serve --url URL TRACE')")
    r.add_argument("--api-model", default=None, help="model name to send with --url (default: the server's first)")
    r.add_argument("--compare", default=None, help="'NAME: flags ; NAME: flags': systems replayed in turn")
    r.add_argument("--name", default=None, help="the system's name when not comparing")
    r.add_argument("--json", default=None, help="write the report here")
    r.add_argument("--plots", default=None, help="write PNG plots into this folder")
    r.add_argument("--step-log", default=None, help="write every executed step here, one JSON line each (its "
                   "shape, its measured time, its system and instance), for 'aserve profile device --from-steps'")
    r.add_argument("--devices", type=int, default=None,
                   help="with --url: devices the server runs on, for goodput per device (default: its instances, "
                        "where the server is aserve)")
    r.add_argument("--timeout", type=float, default=None, help="per system: abort what is left after this many s")
    r.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up request per instance")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add_slo_args(r)
    add_fit_args(r)
    add_engine_args(r)
    add_cluster_args(r)


def register(subparsers) -> None:
    from aserve.replay.workloads import WORKLOADS

    r = subparsers.add_parser("replay", help="replay a request trace and report TTFT/TBT/JCT, resource usage, perf/$")
    add_replay_args(r)
    r.set_defaults(func=cmd_replay, url_note=True)

    w = subparsers.add_parser("workload", help=f"write one of the paper's workloads ({', '.join(WORKLOADS)}), or "
                                               "Chat (multi-turn conversations sharing prefixes), as JSONL")
    w.add_argument("name", help=" | ".join(WORKLOADS + ("Chat",)))
    w.add_argument("--num-requests", type=int, default=128)
    w.add_argument("--out", default=None, help="output file (default traces/NAME.jsonl)")
    w.add_argument("--rate", type=float, default=1.0, help="mean arrival rate, req/s")
    w.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape (1 = Poisson)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--lengths", default=None, help="ShareGPT length table (default: the shared data copy)")
    w.set_defaults(func=cmd_workload)


def cmd_workload(a: argparse.Namespace) -> int:
    from aserve.replay.workloads import SHAREGPT_LENGTHS, canonical_name, make_workload, write_workload

    if a.name.lower() == "chat":  # multi-turn conversations with shared prefixes (hash_ids)
        from aserve.replay.conversations import CHAT, make_conversations

        name = CHAT
        pairs = make_conversations(a.num_requests, a.rate, a.seed, Path(a.lengths or SHAREGPT_LENGTHS))
    else:
        name = canonical_name(a.name)
        pairs = make_workload(name, a.num_requests, a.rate, a.burstiness, a.seed, Path(a.lengths or SHAREGPT_LENGTHS))
    path = write_workload(pairs, a.out or Path("traces") / f"{name}.jsonl")
    reqs = [r for _, r in pairs]
    counts = ", ".join(f"{c} {n}" for c, n in sorted(Counter(c for c, _ in pairs).items()))
    print(f"{path}: {len(reqs)} requests ({counts}), mean prompt {sum(r.prompt_tokens for r in reqs) / len(reqs):.0f} "
          f"and output {sum(r.output_tokens for r in reqs) / len(reqs):.0f} tokens, over {reqs[-1].arrival_s:.1f} s")
    return 0


def _event_loop(specs):
    """Simulated devices replay on virtual time, as fast as the host computes (all or none)."""
    from aserve.devices.factory import is_sim
    from aserve.devices.virtual_time import run_virtual

    sims = {is_sim(s.engine) for s in specs}
    if len(sims) > 1:
        raise ValueError("--compare mixes simulated and real devices: replay them separately")
    return run_virtual if sims == {True} else run_loop


def driver_computes(items) -> bool:
    """Whether any of the (name, flags) systems computes in this process: where every one runs on
    Ray, each actor loads its own weights and the driver needs the model's shape and tokenizer only."""
    return any(system.backend == "local" for _, system in items)


def _tokenizer_and_context(a: argparse.Namespace, engine, weights: bool = True):
    """Over HTTP only the tokenizer is loaded; in-process the whole bundle (once, shared), without
    its weights where no system runs in this process (``weights=False``: every system on Ray, each
    actor loading its own, as a Ray ``serve``'s driver does)."""
    if a.url:
        from transformers import AutoTokenizer

        from model.config import ModelArgs
        from model.loader import read_config, resolve_model

        path = resolve_model(engine.model, Path(engine.cache_dir) if engine.cache_dir else None)
        return None, AutoTokenizer.from_pretrained(path), ModelArgs.from_hf(read_config(path)).max_position
    from aserve.devices.factory import load_bundle

    bundle = load_bundle(engine, weights)
    return bundle, bundle.tokenizer, bundle.args.max_position


async def _run(a, specs, trace, prompts, bundle, progress) -> list:
    from aserve.engine.step_log import StepLog
    from aserve.replay.driver import replay_systems
    from aserve.replay.http_target import replay_http

    if a.url:
        return [await replay_http(a.url, a.name or a.url, trace, prompts, progress, a.api_model, a.timeout)]
    log = StepLog(a.step_log) if a.step_log else None
    try:
        return await replay_systems(specs, trace, prompts, bundle, progress, a.warmup, a.timeout, log)
    finally:
        if log is not None:
            log.close()
            print(f"wrote {log.num_lines} steps to {log.path}")


def _check_flags(a: argparse.Namespace) -> None:
    """Flags that cannot go together, refused before anything heavy is imported; the old spelling's note."""
    if a.url and getattr(a, "url_note", False):
        print(URL_NOTE, file=sys.stderr, flush=True)
    if a.url and (a.compare or a.step_log):
        raise ValueError("--compare and --step-log run in-process systems; they cannot be combined with --url")
    if a.devices is not None and (not a.url or a.devices < 1):
        raise ValueError(f"--devices N (>= 1) is for --url runs (in-process systems count their instances), "
                         f"got {a.devices}")
    if a.chat and (a.max_prompt_tokens or a.length_scale != 1.0 or a.prompts):
        raise ValueError("--chat sends each request's own text whole: it cannot be combined with "
                         "--max-prompt-tokens, --length-scale or --prompts")


def cmd_replay(a: argparse.Namespace) -> int:
    """Fit the trace, build prompts, replay every system, print the table, write JSON and plots."""
    _check_flags(a)
    from aserve.replay.driver import ReplayProgress
    from aserve.replay.report import build_report, print_report, write_json
    from aserve.replay.traces import load_trace
    from aserve.replay.workloads import PromptBuilder

    items = compare_items(a.compare, a) if a.compare else [(a.name, a)]
    slo = slo_from_args(a, items[0][1])  # a corner reads the (first) system's device
    bundle, tokenizer, context = _tokenizer_and_context(a, bundle_engine(a), weights=driver_computes(items))
    builder = PromptBuilder(tokenizer, Path(a.prompts) if a.prompts else None, a.seed, chat=a.chat)
    count = (lambda text: len(builder.chat_ids(text))) if a.chat else \
        (lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    trace = load_trace(a.trace, fit_options(a, context), count)
    prompts = builder.build(trace.requests)
    specs = [] if a.url else build_specs(items, trace.longest_context, slo)
    if not a.url:
        for line in predictor_lines(items):
            print(line)
    with ReplayProgress(a.progress) as progress:
        runs = _event_loop(specs)(_run(a, specs, trace, prompts, bundle, progress))
    summary = {**trace.summary(), "prompts": builder.describe(trace.requests), "target": a.url or "in-process"}
    if a.devices is not None:
        runs = [replace(run, devices=a.devices) for run in runs]
    report = build_report(summary, runs, slo, trace.num_clipped, trace.requests)
    print_report(report)
    if a.json:
        print(f"wrote {write_json(report, a.json)}")
    if a.plots:
        from aserve.replay.plots import write_plots

        for path in write_plots(runs, report, a.plots):
            print(f"wrote {path}")
    bad = sum(s["failed"] + s["aborted"] for s in report["systems"].values())
    return 1 if bad else 0
