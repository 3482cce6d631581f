"""The n choices of one prompt compute it once, on the real default model (fp32, greedy): in every
mode the siblings wait for the first one's prompt, go to its instance, start on its blocks and
answer exactly what n = 1 answers; an abort of the first (or of a held sibling) loses nothing
and every block comes back."""
import asyncio

import pytest
import torch

from aserve.cluster.cluster import Cluster
from aserve.config import ClusterConfig, EngineConfig
from aserve.engine.offline import LLM
from scheduling.request import SamplingParams

pytestmark = pytest.mark.slow
ENGINE = EngineConfig(dtype="fp32", kv_cache_gb=0.25)
SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
N = 4
PROMPT = torch.randint(100, 40000, (150,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def want(default_bundle_fp32):
    return LLM(ENGINE, bundle=default_bundle_fp32).generate([PROMPT], SP)[0].token_ids


async def settle(cl: Cluster) -> None:
    for _ in range(500):
        if not cl.requests and cl.free_blocks() == cl.total_blocks():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks leaked: {cl.free_blocks()} of {cl.total_blocks()}")


@pytest.mark.parametrize("cfg", [ClusterConfig(mode="coupled", num_coupled=2),
                                 ClusterConfig(mode="disagg", num_prefill=2, num_decode=1, chunk_size=64),
                                 ClusterConfig(mode="adaptive", num_prefill=1, num_decode=1)],
                         ids=["coupled2", "disagg2p1d", "adaptive"])
def test_siblings_compute_the_prompt_once_and_answer_as_one(default_bundle_fp32, want, cfg):
    async def run():
        async with Cluster(ENGINE, cfg, bundle=default_bundle_fp32) as cl:
            handles = [cl.submit(PROMPT, SP, request_id=f"c{i}", prefix_group="g") for i in range(N)]
            assert cl.groups.num_held == N - 1  # the first computes the prompt; the others wait for it
            outs = await asyncio.gather(*[collect(cl, h) for h in handles])
            await settle(cl)
            placed = {h.prefill_instance or h.instance_id for h in handles}
            return outs, placed, sum(i.num_prefill_tokens for i in cl.instances.values())

    outs, placed, prefill_tokens = asyncio.run(run())
    assert all(o == want for o in outs), outs
    assert len(placed) == 1, f"siblings spread over {placed}"
    # one prompt of 150 and a block's remainder (150 - 144 = 6 rows) for each sibling, not 4 x 150
    assert prefill_tokens <= len(PROMPT) + (N - 1) * 6, prefill_tokens


async def collect(cl: Cluster, handle) -> list[int]:
    async for ev in cl.stream(handle):
        if ev.finished:
            assert ev.finish_reason == "length", ev
    return handle.request.output_token_ids


def test_an_abort_of_the_first_or_of_a_held_sibling_loses_nothing(default_bundle_fp32, want):
    async def run():
        async with Cluster(ENGINE, ClusterConfig(mode="coupled", num_coupled=1), bundle=default_bundle_fp32) as cl:
            handles = [cl.submit(PROMPT, SP, request_id=f"c{i}", prefix_group="g") for i in range(N)]
            assert cl.abort("c2")  # held: it ends at once, on no instance
            assert handles[2].phase == "done" and handles[2].instance_id is None
            assert cl.abort("c0")  # the first, before its prompt: the held ones go on alone
            outs = await asyncio.gather(*[collect(cl, h) for h in (handles[1], handles[3])])
            await settle(cl)
            return outs, [h.request.finish_reason for h in handles]

    outs, reasons = asyncio.run(run())
    assert outs == [want, want] and reasons == ["abort", "length", "abort", "length"]
