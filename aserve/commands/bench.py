"""``aserve bench engine|swap-int8|interference|ray|capacity``: the benchmarks' command lines."""
from __future__ import annotations

import argparse

from aserve.commands.common import add_cluster_args, add_engine_args, bundle_engine, engine_config
from aserve.commands.replay import add_fit_args, build_specs, compare_items, fit_options


def register(subparsers) -> None:
    b = subparsers.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="prefill/decode speed, HF generate comparison, roofline")
    be.add_argument("--json", default=None, help="write the results here")
    be.add_argument("--quick", action="store_true", help="fewer sizes and steps (smoke test)")
    add_engine_args(be)
    be.set_defaults(func=cmd_bench_engine)
    bs = bsub.add_parser("swap-int8", help="INT8 swap (ALISE Eq. 8): bytes per block, token agreement, logit error")
    bs.add_argument("--num-prompts", type=int, default=20)
    bs.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    add_engine_args(bs)
    bs.set_defaults(func=cmd_bench_swap)
    bi = bsub.add_parser("interference", help="TetriInfer 2.2: prefill beside prefill, decode beside prefill/decode")
    bi.add_argument("--light", type=int, default=128, help="light prompt, and light decode context, in tokens")
    bi.add_argument("--heavy", type=int, default=1024, help="heavy prompt, tokens")
    bi.add_argument("--decode-batch", type=int, default=32)
    bi.add_argument("--heavy-context", type=int, default=2048, help="context of a heavy decode, tokens")
    bi.add_argument("--reps", type=int, default=5, help="timed iterations per figure (median)")
    bi.add_argument("--json", default=None, help="write the results here")
    add_engine_args(bi)
    bi.set_defaults(func=cmd_bench_interference)
    br = bsub.add_parser("ray", help="per-step overhead and real KV hand-over throughput: Ray actors vs in-process")
    br.add_argument("--address", default=None, help="a running Ray cluster (default: start a local Ray)")
    br.add_argument("--decode-batch", type=int, default=16, help="rows of the batched decode step")
    br.add_argument("--chunk", type=int, default=128, help="tokens of the timed prompt chunk")
    br.add_argument("--kv-blocks", default="4,32,128", help="hand-over sizes, in KV blocks, comma-separated")
    br.add_argument("--rounds", type=int, default=5, help="alternating rounds of every figure")
    br.add_argument("--reps", type=int, default=10, help="timed steps per figure per round")
    br.add_argument("--json", default=None, help="write the results here")
    add_engine_args(br)
    br.set_defaults(func=cmd_bench_ray)
    _register_capacity(bsub)


def cmd_bench_engine(a: argparse.Namespace) -> int:
    from aserve.bench.engine import run_engine_bench

    return run_engine_bench(engine_config(a, derive=False), a.json, quick=a.quick)


def cmd_bench_swap(a: argparse.Namespace) -> int:
    from aserve.bench.swap import run_swap_bench

    run_swap_bench(engine_config(a, derive=False), a.num_prompts, a.max_tokens)
    return 0


def cmd_bench_interference(a: argparse.Namespace) -> int:
    from aserve.bench.interference import run_interference_bench

    run_interference_bench(engine_config(a, derive=False), a.light, a.heavy, a.decode_batch, a.heavy_context, a.reps, a.json)
    return 0


def cmd_bench_ray(a: argparse.Namespace) -> int:
    from aserve.bench.ray_overhead import run_ray_bench

    try:
        sizes = tuple(int(x) for x in a.kv_blocks.split(","))
    except ValueError:
        raise ValueError(f"--kv-blocks: comma-separated block counts, got {a.kv_blocks!r}") from None
    if min(sizes) < 1 or min(a.decode_batch, a.chunk, a.rounds, a.reps) < 1:
        raise ValueError("--kv-blocks, --decode-batch, --chunk, --rounds and --reps must be >= 1")
    run_ray_bench(engine_config(a, derive=False), a.address, a.decode_batch, a.chunk, sizes, a.rounds, a.reps, a.json)
    return 0


def _register_capacity(bsub) -> None:
    c = bsub.add_parser("capacity", help="highest request rate within a P99 TBT SLO and a median scheduling delay")
    c.add_argument("trace", help="any trace 'aserve replay' reads; its arrivals are re-drawn at each probed rate")
    c.add_argument("--compare", default=None, help="'NAME: flags ; NAME: flags' (default: the command line's system)")
    c.add_argument("--prompts", default=None, help="JSONL with 'prompt' text (default: random token ids)")
    c.add_argument("--tbt-p99", type=float, default=0.5, help="P99 time-between-tokens SLO, seconds")
    c.add_argument("--delay-p50", type=float, default=2.0, help="median scheduling delay limit, seconds")
    c.add_argument("--rate-lo", type=float, default=0.05, help="lowest rate probed, req/s")
    c.add_argument("--rate-hi", type=float, default=4.0, help="highest rate probed, req/s")
    c.add_argument("--steps", type=int, default=5, help="bisection steps between them")
    c.add_argument("--timeout", type=float, default=None, help="per probe: abort what is left after this many s")
    c.add_argument("--json", default=None, help="write the results here")
    c.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add_fit_args(c)
    add_engine_args(c)
    add_cluster_args(c)
    c.set_defaults(func=cmd_capacity)


def cmd_capacity(a: argparse.Namespace) -> int:
    from aserve.bench.capacity import run_capacity
    from aserve.engine.bundle import ModelBundle
    from aserve.replay.trace_formats import read_trace
    from aserve.replay.traces import fit

    if a.rate is not None:
        raise ValueError("--rate is what bench capacity searches: use --rate-lo and --rate-hi")
    if a.tbt_p99 <= 0 or a.delay_p50 <= 0:
        raise ValueError(f"--tbt-p99 and --delay-p50 must be > 0, got {a.tbt_p99}, {a.delay_p50}")
    items = compare_items(a.compare, a) if a.compare else [(None, a)]
    bundle = ModelBundle.load(bundle_engine(a))
    # read (and count text prompts) once; each probe only re-times the same requests
    raw = read_trace(a.trace, lambda text: len(bundle.tokenizer.encode(text, add_special_tokens=False)))

    def fitted(rate: float):
        return fit(raw, fit_options(a, bundle.args.max_position, rate=rate, time_scale=1.0), str(a.trace))

    specs = build_specs(items, fitted(a.rate_lo).longest_context)
    run_capacity(specs, a.trace, fitted, a.prompts, bundle, a.tbt_p99, a.delay_p50, a.rate_lo, a.rate_hi,
                 a.steps, a.timeout, a.json, a.burstiness, a.seed, a.progress)
    return 0
