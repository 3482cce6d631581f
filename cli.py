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
    g.add_argument("--batching", default="sarathi", help="coupled batching policy: sarathi | vllm")
    g.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = all cores)")
    g.add_argument("--cache-dir", default=None, help="where the dequantised default model is cached")
    g.add_argument("--seed", type=int, default=0)


def engine_config(a: argparse.Namespace):
    from aserve.config import EngineConfig

    return EngineConfig(model=a.model, dtype=a.dtype, device=a.device, attention=a.attention, block_size=a.block_size,
                        kv_cache_gb=a.kv_cache_gb, max_num_batched_tokens=a.max_num_batched_tokens,
                        max_num_seqs=a.max_num_seqs, batching=a.batching, num_threads=a.threads,
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
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="prefill/decode speed, HF generate comparison, roofline")
    be.add_argument("--json", default=None, help="write the results here")
    be.add_argument("--quick", action="store_true", help="fewer sizes and steps (smoke test)")
    add_engine_args(be)
    be.set_defaults(func=cmd_bench_engine)
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
    llm = LLM(engine_config(a))
    if a.prompt is not None:
        out = llm.generate([a.prompt], sp, chat=a.chat)[0]
        print(out.text)
        return 0
    return _chat_loop(llm, sp)


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
