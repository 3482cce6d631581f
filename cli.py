"""aserve's command line: argparse -> frozen configs -> run. Bad input: one line, exit code 2."""
from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 2


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct, bundled), a local HF checkpoint folder, or a .gguf file")
    g.add_argument("--dtype", default="auto", help="auto | bf16 | fp16 | fp32 (auto: bf16 on CUDA and AMX/AVX512-BF16 CPUs)")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:i")
    g.add_argument("--attention", default="sdpa", help="attention backend: reference | sdpa | flash")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool size per instance, GiB")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests in one batch at most")
    g.add_argument("--batching", default="sarathi", help="coupled batching policy: sarathi | vllm | alise")
    g.add_argument("--swap-gb", type=float, default=0.25, help="host swap space for preempted KV, GiB")
    g.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = all cores)")
    g.add_argument("--cache-dir", default=None, help="where the dequantised default model is cached")
    g.add_argument("--seed", type=int, default=0)


def add_cluster_args(p: argparse.ArgumentParser, default_mode: str = "disagg") -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--mode", default=default_mode, help="disagg (prefill and decode instances) | coupled"
                   + (" | offline (no cluster)" if default_mode == "offline" else ""))
    g.add_argument("--prefill", type=int, default=1, help="prefill instances (disagg)")
    g.add_argument("--decode", type=int, default=1, help="decode instances (disagg)")
    g.add_argument("--instances", type=int, default=2, help="coupled instances (coupled)")
    g.add_argument("--prefill-policy", default="fcfs", help="fcfs | sjf | ljf")
    g.add_argument("--prefill-sched-batch", type=int, default=16)
    g.add_argument("--chunk-size", type=int, default=None,
                   help="fixed prefill chunk, tokens (default: the saturate_chunk 'aserve bench engine' measured, else 512)")
    g.add_argument("--no-pad", action="store_true", help="do not pad the last chunk to the chunk size")
    g.add_argument("--dispatch", default="interference",
                   help="interference | random | round-robin | least-loaded | imbalance")
    g.add_argument("--decode-policy", default="greedy", help="greedy | reserve-static | reserve-dynamic")
    g.add_argument("--preemption", default="recompute", help="recompute | swap")
    g.add_argument("--predictor", default="oracle", help="length predictor: oracle | none")
    g.add_argument("--link", default="nvlink", help="nvlink | roce | pcie | bw=25GB/s,latency=5us")
    g.add_argument("--emulate-model", default=None, help="charge the link for this model's KV size (e.g. opt-13b)")
    g.add_argument("--emulate-kv-bytes-per-token", type=int, default=None)
    g.add_argument("--monitor-interval", type=float, default=0.1, help="seconds between load broadcasts")


def cluster_config(a: argparse.Namespace):
    from aserve.config import ClusterConfig
    from aserve.profile_store import saturate_chunk

    chunk = a.chunk_size or saturate_chunk(a.cache_dir, a.model, a.device, a.dtype)
    return ClusterConfig(mode=a.mode, num_prefill=a.prefill, num_decode=a.decode, num_coupled=a.instances,
                         prefill_policy=a.prefill_policy, prefill_sched_batch=a.prefill_sched_batch,
                         chunk_size=chunk, pad=not a.no_pad, dispatch=a.dispatch, decode_policy=a.decode_policy,
                         preemption=a.preemption, predictor=a.predictor, link=a.link, emulate_model=a.emulate_model,
                         emulate_kv_bytes_per_token=a.emulate_kv_bytes_per_token,
                         monitor_interval_s=a.monitor_interval, seed=a.seed)


def engine_config(a: argparse.Namespace):
    from aserve.config import EngineConfig

    return EngineConfig(model=a.model, dtype=a.dtype, device=a.device, attention=a.attention, block_size=a.block_size,
                        kv_cache_gb=a.kv_cache_gb, max_num_batched_tokens=a.max_num_batched_tokens,
                        max_num_seqs=a.max_num_seqs, batching=a.batching, swap_gb=a.swap_gb, num_threads=a.threads,
                        cache_dir=a.cache_dir, seed=a.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt (or chat interactively)")
    g.add_argument("prompt", nargs="?", help="the prompt; omit with --chat for an interactive chat")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-sample", dest="sample_seed", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(g)
    add_cluster_args(g, default_mode="offline")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="prefill/decode speed, HF generate comparison, roofline")
    be.add_argument("--json", default=None, help="write the results here")
    be.add_argument("--quick", action="store_true", help="fewer sizes and steps (smoke test)")
    add_engine_args(be)
    be.set_defaults(func=cmd_bench_engine)
    from aserve.api import add_serve_parser
    from aserve.replay import add_replay_parsers

    from predictors.cli import add_predictor_commands

    add_serve_parser(sub)
    add_replay_parsers(sub)
    add_predictor_commands(sub)
    return p


def sampling_from(a: argparse.Namespace):
    from scheduling.request import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          seed=a.seed if a.temperature > 0 else None, stop=tuple(a.stop), ignore_eos=a.ignore_eos)


def cmd_generate(a: argparse.Namespace) -> int:
    from aserve.engine import LLM

    sp = sampling_from(a)
    if a.prompt is None and not a.chat:
        raise ValueError("give a prompt, or --chat for an interactive chat")
    if a.mode != "offline":
        if a.prompt is None:
            raise ValueError("--chat without a prompt is interactive: use --mode offline")
        print(_generate_cluster(a, sp))
        return 0
    llm = LLM(engine_config(a))
    if a.prompt is not None:
        out = llm.generate([a.prompt], sp, chat=a.chat)[0]
        print(out.text)
        return 0
    return _chat_loop(llm, sp)


def _generate_cluster(a: argparse.Namespace, sp) -> str:
    """One prompt through the in-process cluster (disagg or coupled)."""
    import asyncio

    from aserve.cluster import Cluster

    async def run() -> str:
        async with Cluster(engine_config(a), cluster_config(a)) as cluster:
            ids = cluster.bundle.encode(a.prompt, a.chat)
            req = await cluster.generate(ids, sp)
            return cluster.stops.text(req)

    from aserve.aio import run as run_loop

    return run_loop(run())


def _chat_loop(llm, sp) -> int:
    history = []
    print("aserve chat: type a message, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        out = llm.generate([history], sp)[0]
        history.append({"role": "assistant", "content": out.text})
        print(out.text)


def cmd_bench_engine(a: argparse.Namespace) -> int:
    from aserve.bench_engine import run_engine_bench

    return run_engine_bench(engine_config(a), a.json, quick=a.quick)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from model.loader import ModelNotFound
    from model.config import UnsupportedModel

    try:
        return args.func(args) or 0
    except (ModelNotFound, UnsupportedModel, ValueError, FileNotFoundError) as e:
        print(f"aserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
