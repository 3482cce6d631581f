"""Prefix caching on the real default model (fp32, greedy): in every mode (offline, coupled,
disagg, adaptive) prompts that share a long prefix, and a second turn that resends the first with
its answer, answer exactly what the engine without the cache answers; later prompts start on
cached blocks (the hits are counted), a prompt of another ``cache_salt`` gets none, and every
block comes back (free, cached ones included, == total)."""
import asyncio

import pytest
import torch

from aserve.cluster.cluster import Cluster
from aserve.config import ClusterConfig, EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.engine.offline import LLM
from scheduling.request import SamplingParams
from tests.cluster_support import settled

pytestmark = [pytest.mark.slow, pytest.mark.long]  # 6 minutes on two cores: make test-long; test_prefix_cache (unit) proves the same logic with a content-checking fake KV
SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
_g = torch.Generator().manual_seed(62)
SYSTEM = torch.randint(100, 40000, (120,), generator=_g).tolist()  # 7 full blocks and a part
USERS = [torch.randint(100, 40000, (n,), generator=_g).tolist() for n in (9, 23, 40)]


def engine(caching: bool) -> EngineConfig:
    return EngineConfig(dtype="fp32", attention="reference", kernels="fallback", kv_cache_gb=0.25,
                        enable_prefix_caching=caching)


@pytest.fixture(scope="module")
def bundle():
    return ModelBundle.load(engine(True))


@pytest.fixture(scope="module")
def want(bundle):
    """Without the cache: the first turn, then the other prompts and the first turn's second turn."""
    llm = LLM(engine(False), bundle=bundle)
    first = SYSTEM + USERS[0]
    out0 = llm.generate([first], SP)[0].token_ids
    rest = [SYSTEM + USERS[1], SYSTEM + USERS[2], first + out0 + USERS[1][:5]]
    assert llm.blocks.num_hit_tokens == 0 and llm.blocks.num_cached == 0
    return first, out0, rest, [c.token_ids for c in llm.generate(rest, SP)]


def test_offline_engine_answers_as_without_the_cache_and_hits(bundle, want):
    first, out0, rest, want_rest = want
    llm = LLM(engine(True), bundle=bundle)
    assert llm.generate([first], SP)[0].token_ids == out0
    assert [c.token_ids for c in llm.generate(rest, SP)] == want_rest
    b = llm.blocks
    # each later prompt found the system prompt's 7 full blocks, the second turn its whole first turn
    assert b.num_hit_tokens >= 3 * 112, b.num_hit_tokens
    assert b.num_free == b.num_blocks and b.num_cached > 0
    b.check()
    assert [c.token_ids for c in llm.generate(rest, SP)] == want_rest  # all cached now: still the same


@pytest.mark.parametrize("cfg", [ClusterConfig(mode="coupled", num_coupled=1),
                                 ClusterConfig(mode="disagg", num_prefill=1, num_decode=1, chunk_size=64),
                                 ClusterConfig(mode="adaptive", num_prefill=1, num_decode=1)],
                         ids=["coupled", "disagg", "adaptive"])
def test_every_mode_answers_as_without_the_cache(bundle, want, cfg):
    first, out0, rest, want_rest = want

    async def run():
        async with Cluster(engine(True), cfg, bundle=bundle) as cl:
            r0 = await cl.generate(first, SP)
            reqs = await asyncio.gather(*[cl.generate(p, SP) for p in rest])
            salted = cl.submit(rest[0], SP, request_id="salted", cache_salt="another tenant")
            async for _ in cl.stream(salted):
                pass
            await settled(cl, list(cl.instances))
            for inst in cl.instances.values():
                inst.blocks.check()
            hits = sum(i.blocks.num_hit_tokens for i in cl.instances.values())
            cached = sum(i.blocks.num_cached for i in cl.instances.values())
            return r0.output_token_ids, [r.output_token_ids for r in reqs], salted.request, hits, cached

    got0, got, salted, hits, cached = asyncio.run(run())
    assert got0 == out0 and got == want_rest, cfg.mode
    assert salted.output_token_ids == want_rest[0] and salted.num_cached_tokens == 0
    assert hits >= 112 and cached > 0, (hits, cached)
