"""``aserve generate``: one prompt (or an interactive chat), offline or through the cluster."""
from __future__ import annotations

import argparse
import sys

from aserve.commands.common import add_cluster_args, add_engine_args, engine_and_cluster, engine_config, sampling_from


def register(subparsers) -> None:
    g = subparsers.add_parser("generate", help="generate text for one prompt (or chat interactively)")
    g.add_argument("prompt", nargs="?", help="the prompt; omit with --chat for an interactive chat")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(g)
    add_cluster_args(g, default_mode="offline")
    g.set_defaults(func=cmd_generate, predictor="oracle")  # one prompt, no comparison: as before issue 54


def cmd_generate(a: argparse.Namespace) -> int:
    from aserve.engine.offline import LLM

    sp = sampling_from(a)
    if a.prompt is None and not a.chat:
        raise ValueError("give a prompt, or --chat for an interactive chat")
    if a.mode == "offline" and a.backend != "local":
        raise ValueError(f"--cluster {a.backend} runs instances as Ray actors: give --mode disagg, coupled or adaptive "
                         "(--mode offline runs no cluster)")
    if a.mode != "offline":
        if a.prompt is None:
            raise ValueError("--chat without a prompt is interactive: use --mode offline")
        print(_generate_cluster(a, sp))
        return 0
    from aserve.devices.measured import resolve

    llm = LLM(resolve(engine_config(a))[0])
    if a.prompt is not None:
        out = llm.generate([a.prompt], sp, chat=a.chat)[0]
        print(out.text)
        return 0
    return _chat_loop(llm, sp)


def _generate_cluster(a: argparse.Namespace, sp) -> str:
    """One prompt through the in-process cluster (disagg or coupled)."""
    from aserve.cluster.cluster import Cluster
    from aserve.event_loop import run as run_loop

    async def run() -> str:
        async with Cluster(*engine_and_cluster(a)) as cluster:
            ids = cluster.bundle.encode(a.prompt, a.chat)
            req = await cluster.generate(ids, sp)
            return cluster.stops.text(req)

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
