"""Instance lifecycle on the real default model (fp32, so greedy outputs compare exactly):
flips under load, adding and removing instances, and fault drills — a decode instance killed,
a prefill step that raises, a KV transfer that fails — while 20 requests stream through
2 prefill + 2 decode instances. Every request must finish with the output of a fault-free run,
none may hang, and the surviving instances must get every block back."""
import asyncio

import pytest
import torch

from aserve.cluster.cluster import Cluster
from aserve.config import ClusterConfig, EngineConfig
from aserve.engine.offline import LLM
from aserve.cluster.lifecycle import InstanceError
from scheduling.request import SamplingParams
from tests.cluster_support import check, settled, stream_all

pytestmark = pytest.mark.slow
SP = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
ENGINE = EngineConfig(dtype="fp32", kv_cache_gb=0.25, num_threads=1)
TWO_TWO = ClusterConfig(mode="disagg", num_prefill=2, num_decode=2, chunk_size=64)


@pytest.fixture(scope="module")
def workload(default_bundle_fp32):
    """20 prompts of 8..96 tokens and their fault-free greedy outputs (offline engine). (32 cost
    the three drills in make test about 15 s more and hit no more paths: the kill still lands on a
    decode instance holding requests, which the drills assert.)"""
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(8, 96, (20,), generator=g).tolist()
    ids = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]
    want = [c.token_ids for c in LLM(ENGINE, bundle=default_bundle_fp32).generate(ids, SP)]
    return default_bundle_fp32, ids, want


def drill(workload, during, after_tokens=40, then=None):
    """The 20 requests through a fresh 2 + 2 cluster; ``during(cl)`` fires once ``after_tokens``
    tokens have streamed. Every output must equal the fault-free run's and every instance still
    active must get all its blocks back; ``then(cl)`` checks the rest."""
    bundle, ids, want = workload

    async def main():
        async with Cluster(ENGINE, TWO_TWO, bundle=bundle) as cl:
            check(await stream_all(cl, ids, SP, during, after_tokens), want)
            await settled(cl, [i for i, inst in cl.instances.items() if inst.state == "active"])
            if then is not None:
                await then(cl)
    asyncio.run(main())


@pytest.mark.long  # its logic on virtual time: test_control_plane's twin (unit tier)
def test_killed_decode_instance_loses_no_request(workload):
    async def kill(cl):
        assert cl.instances["d2"].num_requests > 0, "the drill must hit a busy instance"
        cl.lifecycle.kill("d2", "drill: worker killed")

    async def then(cl):
        assert cl.instances["d2"].state == "failed"
        assert cl.lifecycle.counts["reruns"] > 0 and cl.lifecycle.counts["instance_failures"] == 1
        assert any(e["kind"] == "instance_failed" for e in cl.log.events)
        (failure,) = cl.lifecycle.failure_log  # every request it held streams again: the recovery time
        assert failure["instance"] == "d2" and failure["requests"] > 0 and 0 < failure["recovered_s"] < 60
    drill(workload, kill, then=then)


@pytest.mark.long  # the soak's kills and the decode-kill drill cover the loss
def test_prefill_step_that_raises_loses_no_request(workload):
    async def fault(cl):
        cl.lifecycle.inject_fault("p0")
        for _ in range(1000):
            if cl.instances["p0"].state == "failed" or not cl.instances["p0"].num_requests:
                return
            await asyncio.sleep(0.005)

    async def then(cl):
        assert cl.instances["p0"].state == "failed"
        assert "injected fault" in cl.instances["p0"].failure
    drill(workload, fault, after_tokens=2, then=then)


@pytest.mark.long  # the soak fails transfers; test_transfer_failures has the policies
def test_failed_transfer_is_retried_and_frees_both_sides(workload):
    async def fail_links(cl):
        cl.handoff.inject_faults(3)

    async def then(cl):
        counts = cl.handoff.counts
        assert counts["transfer_failures"] == 3 and counts["transfer_timeouts"] == 0
        # each failure was retried, or was a request's third and it was recomputed
        assert counts["transfer_retries"] + counts["transfer_recomputes"] == 3
        assert sum(link.stats()["num_failed"] for link in cl.handoff.links.values()) == 3
    drill(workload, fail_links, after_tokens=1, then=then)


def test_on_failure_error_ends_a_killed_instances_requests_with_its_reason(workload):
    """``on_failure="error"``: the requests the killed decode instance held end with an error
    naming it (none is re-run); every other request ends with its fault-free tokens."""
    bundle, ids, want = workload

    async def main():
        cfg = ClusterConfig(mode="disagg", num_prefill=2, num_decode=2, chunk_size=64, on_failure="error")
        async with Cluster(ENGINE, cfg, bundle=bundle) as cl:
            async def kill(cl):
                assert cl.instances["d2"].num_requests > 0, "the drill must hit a busy instance"
                cl.lifecycle.kill("d2", "drill: worker killed")
            results = await stream_all(cl, ids, SP, kill)
            failed = [err for _, reason, err in results if reason == "error"]
            assert failed and all(err == "instance d2 failed: drill: worker killed" for err in failed)
            for (toks, reason, err), w in zip(results, want):
                assert reason in ("length", "error") and (reason == "error" or toks == w)
            assert cl.lifecycle.counts["reruns"] == 0
            await settled(cl, [i for i, inst in cl.instances.items() if inst.state == "active"])
    asyncio.run(main())


@pytest.mark.long  # its logic on virtual time: test_control_plane's twin (unit tier)
def test_no_instance_left_ends_requests_with_a_clear_error(workload):
    bundle, ids, _ = workload

    async def main():
        async with Cluster(ENGINE, ClusterConfig(mode="disagg", chunk_size=64), bundle=bundle) as cl:
            async def kill_both(cl):
                cl.lifecycle.kill("d1")
                cl.lifecycle.kill("p0")
            results = await stream_all(cl, ids[:8], SP, kill_both, after_tokens=3, timeout=60)
            assert all(reason == "error" and "no healthy instance" in err for _, reason, err in results)
            assert not cl.requests
    asyncio.run(main())


@pytest.mark.long  # test_adaptive_cluster flips a loaded instance and checks its outputs; the soak flips throughout
def test_flip_under_load_keeps_outputs_and_is_fast(workload):
    _, ids, want = workload
    records = []

    async def flips(cl):
        records.append(await cl.lifecycle.flip("p0", "decode", reason="test"))
        records.append(await cl.lifecycle.flip("d2", "prefill", reason="test"))

    async def then(cl):
        assert {i.id: i.role for i in cl.instances.values()} == {"p0": "decode", "p1": "prefill",
                                                                 "d2": "prefill", "d3": "decode"}
        for r in records:
            assert r["flip_s"] < 0.05, r  # the switch alone; the drain is reported apart
            assert r["drain_s"] >= 0
        assert cl.lifecycle.counts["flips"] == 2 and len(cl.lifecycle.flip_log) == 2
        check(await stream_all(cl, ids[:8], SP), want[:8])  # the flipped instances serve in their new roles
        assert cl.instances["p0"].num_decode_tokens > 0 and cl.instances["d2"].num_prefill_tokens > 0
        await cl.lifecycle.flip("p1")  # idle: drains at once
        with pytest.raises(InstanceError, match="last active prefill"):
            await cl.lifecycle.flip("d2")
    drill(workload, flips, after_tokens=20, then=then)


def test_adding_an_instance_does_not_stall_the_event_loop(default_bundle_fp32):
    """A new instance's KV pool (2 GB of zeros here, a second on this machine) is built off the
    loop: a probe that ticks every 10 ms never waits 250 ms while the instance is added."""
    big = EngineConfig(dtype="fp32", kv_cache_gb=2.0, num_threads=1)

    async def main():
        async with Cluster(big, ClusterConfig(mode="coupled", num_coupled=1, chunk_size=64),
                           bundle=default_bundle_fp32) as cl:
            worst, done = 0.0, asyncio.Event()

            async def probe():
                nonlocal worst
                loop = asyncio.get_running_loop()
                while not done.is_set():
                    t = loop.time()
                    await asyncio.sleep(0.01)
                    worst = max(worst, loop.time() - t - 0.01)
            ticker = asyncio.create_task(probe())
            await asyncio.sleep(0.05)
            new = await cl.lifecycle.add("coupled")
            done.set()
            await ticker
            assert new.state == "active" and cl.free_blocks()[new.id] == cl.total_blocks()[new.id] > 0
            assert worst < 0.25, f"the loop stalled {worst:.3f} s while an instance was added"
    asyncio.run(main())


def test_lease_frees_blocks_reserved_for_kv_that_never_arrives(default_bundle_fp32):
    from scheduling.request import Request

    async def main():
        cfg = ClusterConfig(mode="disagg", lease_s=0.2, monitor_interval_s=0.05)
        async with Cluster(ENGINE, cfg, bundle=default_bundle_fp32) as cl:
            d = cl.instances["d1"]
            ghost = Request("ghost", list(range(1, 100)), SP)
            ghost.num_computed_tokens = 99
            assert d.reserve_kv(ghost) is not None
            assert d.blocks.num_free < d.blocks.num_blocks
            await asyncio.sleep(0.5)
            assert d.blocks.num_free == d.blocks.num_blocks
            assert cl.lifecycle.counts["decode_leases_expired"] == 1
    asyncio.run(main())


def test_dedicated_device_emulation_paces_each_instance(default_bundle_fp32):
    """4 instances on 2 cores, dedicated: each owns half a core, so its busy time is at least
    twice its CPU time; shared: no pacing."""
    async def main(share):
        cfg = ClusterConfig(mode="disagg", num_prefill=2, num_decode=2, chunk_size=64, device_share=share)
        eng = EngineConfig(dtype="fp32", kv_cache_gb=0.25, num_threads=2)
        async with Cluster(eng, cfg, bundle=default_bundle_fp32) as cl:
            assert cl.core_share.slowdown() == (2.0 if share == "dedicated" else 1.0)
            short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)  # pacing shows in any step
            await asyncio.gather(*[cl.generate(list(range(100, 140)), short) for _ in range(4)])
            return [(i.busy_s, i.device.cpu_s) for i in cl.instances.values() if i.num_steps]
    for busy, cpu in asyncio.run(main("dedicated")):
        assert cpu > 0 and busy >= 2 * cpu * 0.999
    assert ClusterConfig(device_share="shared").device_share == "shared"
    with pytest.raises(ValueError, match="bad device_share"):
        ClusterConfig(device_share="private")
    asyncio.run(main("shared"))


def test_lent_cores_serve_a_lone_prompt_and_change_no_token(default_bundle_fp32):
    """device_share lend (aserve/devices/cores.py), 2 coupled instances on 2 threads: a lone
    prompt's chunks take both threads (its idle sibling's too), its decode steps one, and the
    greedy tokens are those of the same cluster without lending; two prompts at once keep one
    thread each (nothing lent while both have work)."""
    prompt = list(range(200, 456))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main(share, together=False):
        eng = EngineConfig(dtype="fp32", kv_cache_gb=0.25, num_threads=2, max_num_batched_tokens=64)
        async with Cluster(eng, ClusterConfig(mode="coupled", num_coupled=2, device_share=share),
                           bundle=default_bundle_fp32) as cl:
            prompts = [prompt, prompt[::-1]] if together else [prompt]
            outs = await asyncio.gather(*[cl.generate(p, greedy) for p in prompts])
            lender = cl.core_share.lender
            return [list(o.output_token_ids) for o in outs], (dict(lender.counts) if lender else None)

    alone, counts = asyncio.run(main("lend"))
    assert counts["lent_steps"] >= 4  # the prompt's four 64-token chunks on both threads
    assert counts["steps"] - counts["lent_steps"] >= 7  # its decode steps (one row) on one
    assert alone == asyncio.run(main("shared"))[0]
    together, counts = asyncio.run(main("lend", together=True))
    assert len(together) == 2 and all(len(t) == 8 for t in together)
    assert counts["lent_steps"] <= 2  # at most before the second prompt's instance woke
