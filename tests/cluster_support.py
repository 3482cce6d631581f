"""Fault drills on a live cluster: stream many requests, fire something mid-way, check that every
request ends as a fault-free run would and that the survivors got every block back (used by
test_lifecycle.py in one process and test_ray_cluster.py on Ray actors)."""
from __future__ import annotations

import asyncio

from aserve.cluster.cluster import Cluster
from scheduling.request import SamplingParams


async def stream_all(cl: Cluster, ids, sp: SamplingParams, during=None, after_tokens: int = 40,
                     timeout: float = 300):
    """Submit everything, run ``during(cl)`` once ``after_tokens`` tokens have streamed in all,
    and return every request's streamed token ids and finish reason."""
    handles = [cl.submit(p, sp, request_id=f"r{i}") for i, p in enumerate(ids)]
    streamed = [0]
    fired = asyncio.Event()

    async def consume(h):
        toks = []
        async for ev in cl.stream(h):
            if ev.token_id is not None:
                toks.append(ev.token_id)
                streamed[0] += 1
                if streamed[0] >= after_tokens:
                    fired.set()
            if ev.finished:
                return toks, ev.finish_reason, ev.error

    async def trigger():
        if during is not None:
            await fired.wait()
            await during(cl)

    results, _ = await asyncio.wait_for(asyncio.gather(asyncio.gather(*map(consume, handles)), trigger()), timeout)
    return results


async def settled(cl: Cluster, survivors) -> None:
    """Every surviving instance has all its blocks back (transfers may land a moment later)."""
    for _ in range(500):
        if not cl.requests and all(cl.instances[i].blocks.num_free == cl.instances[i].blocks.num_blocks
                                   for i in survivors):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks leaked: {cl.free_blocks()} of {cl.total_blocks()}, requests {list(cl.requests)}")


def check(results, want):
    for i, ((toks, reason, err), w) in enumerate(zip(results, want)):
        assert err is None and reason == "length", (i, reason, err)
        assert toks == w, f"request {i}: streamed output differs from the fault-free run"


def sim_bundle(device: str):
    """A simulated profile's model shape (``device``: ``sim:NAME``) with a small real tokenizer (a
    word-level vocabulary): what a cluster of simulated devices reads from a bundle, without the
    served model's files (the unit tier loads no model)."""
    from pathlib import Path

    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from aserve.config import EngineConfig
    from aserve.devices.factory import model_args
    from aserve.engine.bundle import ModelBundle

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(510)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    return ModelBundle(Path(device), model_args(EngineConfig(device=device)), None, fast, torch.float16, device)
