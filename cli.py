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
    g.add_argument("--attention", default="auto",
                   help="attention backend: auto | reference | sdpa | native | flash (auto: native on CPU, flash or sdpa on CUDA)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool size per instance, GiB")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: with --batching sarathi the budget "
                        "'aserve profile token-budget' saved for this model, else 512)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests in one batch at most")
    g.add_argument("--batching", default="sarathi", help="coupled batching policy: sarathi | vllm | alise")
    g.add_argument("--swap-gb", type=float, default=0.25, help="host swap space for preempted KV, GiB")
    g.add_argument("--swap-dtype", default="same",
                   help="how swapped KV is stored: same (the model dtype) | int8 (channel-wise scales, ALISE Eq. 8)")
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
    g.add_argument("--predictor", default="oracle",
                   help="output-length predictor: none | oracle | sklearn | lm | retrieval (predictors/README.md)")
    g.add_argument("--predictor-granularity", type=int, default=200,
                   help="length bucket width, tokens: 100 | 200 | 400")
    g.add_argument("--predictor-mode", default="parallel",
                   help="parallel: beside the prefill, awaited at the KV handoff | "
                        "sequential: before the prefill (adds to TTFT)")
    g.add_argument("--predictor-features", default="auto",
                   help="auto | prefill | prompt: where a predictor whose backbone is the served model (lm) "
                        "gets its features: the request's own prefill (auto: where it can, disagg + parallel) "
                        "or its own pass over the prompt")
    g.add_argument("--predictor-timeout", type=float, default=0.5,
                   help="seconds a prediction may take; past them the request goes on without one (counted)")
    g.add_argument("--predictor-option", action="append", default=[], metavar="KEY=VALUE",
                   help="backend option, repeatable, JSON values (e.g. device=cuda, classifier=logreg)")
    g.add_argument("--predictor-path", default=None,
                   help="a saved predictor folder (default: the artefact 'aserve predictor train' caches, else fit one)")
    g.add_argument("--predictor-labels", default=None,
                   help="labels to fit on when no artefact exists (default: the committed set)")
    g.add_argument("--predictor-prompts", default=None,
                   help="the prompts those labels refer to (default: the shared pool)")
    g.add_argument("--link", default="nvlink", help="nvlink | roce | pcie | bw=25GB/s,latency=5us")
    g.add_argument("--emulate-model", default=None, help="charge the link for this model's KV size (e.g. opt-13b)")
    g.add_argument("--emulate-kv-bytes-per-token", type=int, default=None)
    g.add_argument("--monitor-interval", type=float, default=0.1, help="seconds between load broadcasts")
    g.add_argument("--flip", default="off", help="instance flips: off | idle | ratio (disagg)")
    g.add_argument("--flip-window", type=float, default=10.0, help="ratio flips: seconds of measured work")
    g.add_argument("--flip-idle", type=float, default=60.0, help="idle flips: seconds an instance must be idle")
    g.add_argument("--on-failure", default="rerun", help="a failed instance's requests: rerun | error")
    g.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds before a KV transfer is retried")
    g.add_argument("--lease", type=float, default=60.0,
                   help="seconds before decode blocks reserved for KV that never came are freed")
    g.add_argument("--device-share", default="shared",
                   help="shared: instances share the CPU's cores | dedicated: emulate one device per instance "
                        "(cores/N of a core each, an idle instance's share is lost), as on GPUs")


def cluster_config(a: argparse.Namespace):
    from aserve.config import ClusterConfig
    from aserve.profile_store import saturate_chunk
    from predictors.cli import parse_options

    chunk = a.chunk_size or saturate_chunk(a.cache_dir, a.model, a.device, a.dtype)
    return ClusterConfig(mode=a.mode, num_prefill=a.prefill, num_decode=a.decode, num_coupled=a.instances,
                         prefill_policy=a.prefill_policy, prefill_sched_batch=a.prefill_sched_batch,
                         chunk_size=chunk, pad=not a.no_pad, dispatch=a.dispatch, decode_policy=a.decode_policy,
                         preemption=a.preemption, predictor=a.predictor, predictor_granularity=a.predictor_granularity,
                         predictor_mode=a.predictor_mode, predictor_timeout_s=a.predictor_timeout,
                         predictor_features=a.predictor_features,
                         predictor_options=parse_options(a.predictor_option, "predictor-option"),
                         predictor_path=a.predictor_path, predictor_labels=a.predictor_labels,
                         predictor_prompts=a.predictor_prompts, link=a.link, emulate_model=a.emulate_model,
                         emulate_kv_bytes_per_token=a.emulate_kv_bytes_per_token,
                         monitor_interval_s=a.monitor_interval, flip=a.flip, flip_window_s=a.flip_window,
                         flip_idle_s=a.flip_idle, on_failure=a.on_failure, transfer_timeout_s=a.transfer_timeout,
                         lease_s=a.lease, device_share=a.device_share, seed=a.seed)


def engine_config(a: argparse.Namespace):
    from aserve.config import EngineConfig
    from aserve.profile_store import DEFAULT_TOKEN_BUDGET, token_budget

    budget = a.max_num_batched_tokens
    if budget is None:
        saved = token_budget(a.cache_dir, a.model, a.device, a.dtype, a.threads) if a.batching == "sarathi" else None
        budget = saved or DEFAULT_TOKEN_BUDGET
    return EngineConfig(model=a.model, dtype=a.dtype, device=a.device, attention=a.attention, block_size=a.block_size,
                        kv_cache_gb=a.kv_cache_gb, max_num_batched_tokens=budget,
                        max_num_seqs=a.max_num_seqs, batching=a.batching, swap_gb=a.swap_gb,
                        swap_dtype=a.swap_dtype, num_threads=a.threads, cache_dir=a.cache_dir, seed=a.seed)


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
    from aserve.bench_capacity import add_capacity_parser

    add_capacity_parser(bsub)

    pr = sub.add_parser("profile", help="measure the engine to choose a setting")
    prsub = pr.add_subparsers(dest="profile", required=True)
    pt = prsub.add_parser("token-budget", help="the largest Sarathi token budget whose iteration meets a TBT SLO")
    pt.add_argument("--tbt-slo", type=float, required=True, help="time-between-tokens SLO, seconds")
    pt.add_argument("--decode-batch", type=int, default=32, help="running decodes in each iteration")
    pt.add_argument("--context", type=int, default=512, help="tokens of context of each decode and of the chunk")
    pt.add_argument("--tile", type=int, default=64, help="candidates and the result are multiples of this")
    pt.add_argument("--max-budget", type=int, default=4096, help="largest budget tried")
    pt.add_argument("--repeats", type=int, default=3, help="timed iterations per budget, after one warm-up")
    pt.add_argument("--no-save", action="store_true", help="do not save the budget as the sarathi default")
    add_engine_args(pt)
    pt.set_defaults(func=cmd_profile_budget)
    from aserve.api import add_serve_parser
    from aserve.replay import add_replay_parsers

    from predictors.cli import add_predictor_commands

    add_serve_parser(sub)
    add_replay_parsers(sub)
    add_predictor_commands(sub)
    from aserve.monitor import add_monitor_parser

    add_monitor_parser(sub)  # aserve monitor: the live dashboard (docs/MONITOR.md)
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


def cmd_bench_swap(a: argparse.Namespace) -> int:
    from aserve.bench_swap import run_swap_bench

    run_swap_bench(engine_config(a), a.num_prompts, a.max_tokens)
    return 0


def cmd_bench_interference(a: argparse.Namespace) -> int:
    from aserve.bench_interference import run_interference_bench

    run_interference_bench(engine_config(a), a.light, a.heavy, a.decode_batch, a.heavy_context, a.reps, a.json)
    return 0


def cmd_profile_budget(a: argparse.Namespace) -> int:
    from aserve.profile_budget import BudgetProfile, run_budget_profile

    prof = BudgetProfile(a.tbt_slo, a.decode_batch, a.context, a.tile, a.max_budget, a.repeats)
    run_budget_profile(engine_config(a), prof, save=not a.no_save)
    return 0


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
