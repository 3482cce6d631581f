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
