"""``aserve bench engine|swap-int8|interference|ray|goodput|serve``: the benchmarks' command lines.

``bench serve`` is load against a running server, as ``vllm bench serve``: ``aserve replay``'s own
parser (aserve/commands/replay.py: add_replay_args) with ``--url`` required, run by the same command.
"""
from __future__ import annotations

import argparse

from aserve.commands.common import add_cluster_args, add_engine_args, engine_config
from aserve.commands.replay import add_fit_args, add_replay_args, cmd_replay
from aserve.commands.slo_args import add_slo_args


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
    br.add_argument("--nodes", type=int, default=1,
                    help="without --address: a local Ray of this many nodes on this machine (Ray's multi-node "
                         "harness, the cores split between them), so the two actors run on different nodes")
    br.add_argument("--decode-batch", type=int, default=16, help="rows of the batched decode step")
    br.add_argument("--chunk", type=int, default=128, help="tokens of the timed prompt chunk")
    br.add_argument("--kv-blocks", default="4,32,128", help="hand-over sizes, in KV blocks, comma-separated")
    br.add_argument("--rounds", type=int, default=5, help="alternating rounds of every figure")
    br.add_argument("--reps", type=int, default=10, help="timed steps per figure per round")
    br.add_argument("--json", default=None, help="write the results here")
    add_engine_args(br)
    br.set_defaults(func=cmd_bench_ray)
    _register_goodput(bsub)
    sv = bsub.add_parser("serve", help="load a running OpenAI-compatible server (aserve, vLLM, ...) with a trace; "
                                       "the report of 'aserve replay'",
                         description="Replays TRACE against the server at --url (alias --base-url, as 'vllm bench "
                                     "serve'): TTFT/TBT/JCT, SLO attainment and goodput. The flags are those of "
                                     "'aserve replay' (one parser: aserve/commands/replay.py). Of the engine and "
                                     "cluster flags only --model and --cache-dir (the tokenizer that sizes the "
                                     "prompts), --seed, and the device flags an --slo corner's units are measured on "
                                     "are read; --compare and --step-log, which run in-process systems, are refused. "
                                     "'aserve replay TRACE --url URL' is the old spelling and still works.")
    add_replay_args(sv, url_required=True)
    sv.set_defaults(func=cmd_replay, url_note=False)


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
    if min(sizes) < 1 or min(a.decode_batch, a.chunk, a.rounds, a.reps, a.nodes) < 1:
        raise ValueError("--kv-blocks, --decode-batch, --chunk, --rounds, --reps and --nodes must be >= 1")
    if a.nodes > 1 and a.address:
        raise ValueError("--nodes starts a local Ray of its own: leave out --address")
    run_ray_bench(engine_config(a, derive=False), a.address, a.decode_batch, a.chunk, sizes, a.rounds, a.reps, a.json,
                  a.nodes)
    return 0


def _register_goodput(bsub) -> None:
    c = bsub.add_parser("goodput", help="per system, the highest arrival rate at which >= 90%% of requests meet every "
                                        "SLO (goodput per device, the knee and its error bar, attainment-vs-rate plot)")
    c.add_argument("trace", help="any trace 'aserve replay' reads; its arrivals are re-timed to each probed rate")
    c.add_argument("--compare", default=None, help="'NAME: flags ; NAME: flags' (default: the command line's system)")
    c.add_argument("--name", default=None, help="the system's name when not comparing")
    c.add_argument("--prompts", default=None, help="JSONL with 'prompt' text (default: random token ids)")
    c.add_argument("--target", type=float, default=0.9, help="share of requests that must be good (DistServe: 0.9)")
    c.add_argument("--rate-start", type=float, default=None,
                   help="req/s of the first point (default: the trace's own mean rate; on a real device the knee a "
                        "simulation on this machine's profile predicts)")
    c.add_argument("--precision", type=float, default=0.05,
                   help="stop once the lowest failing rate is within this fraction above the knee (its error bar)")
    c.add_argument("--max-points", type=int, default=12, help="probed rates per system at most")
    c.add_argument("--repeats", type=int, default=1,
                   help="real devices: replays of each probed rate, pooled (its attainment over every request of "
                        "every replay; each replay's own is logged and kept): one replay is one draw of the machine's "
                        "minutes, and near a bursty trace's knee draws pass and fail at the same rate")
    c.add_argument("--estimate-only", action="store_true",
                   help="real devices: print the estimated wall time (the search simulated on sim:local) and stop")
    c.add_argument("--estimate-device", default=None, metavar="sim:PROFILE",
                   help="the simulated twin a real device's search is estimated (and started) on (default: sim:local, "
                        "this machine's measured engine, on a CPU; none on a GPU)")
    c.add_argument("--timeout", type=float, default=None, help="per point: abort what is left after this many s")
    c.add_argument("--json", default=None, help="write the results here")
    c.add_argument("--plot", default=None, help="write the attainment-vs-rate plot here (PNG)")
    c.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add_slo_args(c, corner_help="; required")
    add_fit_args(c)
    add_engine_args(c)
    add_cluster_args(c)
    c.set_defaults(func=cmd_goodput)


def cmd_goodput(a: argparse.Namespace) -> int:
    from aserve.commands.goodput import run_goodput_command

    return run_goodput_command(a)
