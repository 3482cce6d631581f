"""The cluster with one Ray actor per instance (``backend="ray"``), on the session's local Ray
(two CPUs, a small object store), the real default model in fp32 so greedy outputs compare
exactly: the same tokens as in-process for coupled and disagg, KV moved actor to actor (the
direct wire, and the object store when asked) with both its real and its emulated time on
record, and an actor killed mid-run — every
request completes (re-run elsewhere) with the fault-free output, no block and no pinned export
is left, and the recovery time is on record."""
import asyncio
import re

import pytest
import torch

from aserve.cluster.cluster import Cluster
from aserve.config import ClusterConfig, EngineConfig
from aserve.engine.offline import LLM
from scheduling.request import SamplingParams
from tests.cluster_support import check, settled, stream_all

pytestmark = pytest.mark.slow
ENGINE = EngineConfig(dtype="fp32", kv_cache_gb=0.1)
SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def offline(default_bundle_fp32):
    llm = LLM(ENGINE, bundle=default_bundle_fp32)
    return lambda ids, sp=SP: [c.token_ids for c in llm.generate(ids, sp)]


async def settled_on_ray(cl: Cluster, survivors) -> None:
    """Every surviving instance has its blocks back and its actor holds no export."""
    await settled(cl, survivors)
    for iid in survivors:
        held = await cl.instances[iid].device.held()
        assert held["exports"] == {}, (iid, held)


@pytest.mark.long  # test_ray_device moves real KV through the actor's device
def test_same_greedy_output_as_in_process(local_ray, default_bundle_fp32, offline):
    ids = prompts([5, 17, 64, 130, 300])
    want = offline(ids)

    async def run(cfg):
        async with Cluster(ENGINE, cfg, bundle=default_bundle_fp32) as cl:
            assert all(i.device.kind.startswith("ray:cpu@") for i in cl.instances.values())
            assert all(i.device.niceness == 0 for i in cl.instances.values())  # not Ray's 15 for workers
            reqs = await asyncio.gather(*[cl.generate(p, SP) for p in ids])
            await settled_on_ray(cl, list(cl.instances))
            links = [link.stats() for link in cl.handoff.links.values()]
            steps = sum(i.device.num_steps for i in cl.instances.values())
            sent = cl.instances["p0"].device.kv_sent if "p0" in cl.instances else None
            return [r.output_token_ids for r in reqs], links, steps, sent

    got, links, steps, _ = asyncio.run(run(ClusterConfig(mode="coupled", num_coupled=2, backend="ray")))
    assert got == want and not links and steps > 0
    for transport in ("direct", "socket", "object-store"):
        got, links, _, sent = asyncio.run(run(ClusterConfig(mode="disagg", chunk_size=64, backend="ray",
                                                            ray_kv=transport)))
        assert got == want
        # every prompt's KV went that way: direct, on this one host, through shared memory
        way = {"direct": ("direct", "shared-memory"), "socket": ("direct",), "object-store": ("object-store",)}
        assert sent == {k: len(ids) if k in way[transport] else 0 for k in ("direct", "shared-memory", "object-store")}
        (stats,) = links  # p0 -> d1
        assert stats["num_done"] == len(ids) and stats["bytes"] > 0
        assert 0 < stats["real_copy_s"] <= stats["emulated_s"]  # the emulated time never hides the real one


@pytest.mark.long
def test_killed_actor_mid_run_loses_no_request(local_ray, default_bundle_fp32, offline):
    """1 prefill + 2 decode actors; once 40 tokens have streamed, the decode actor holding the
    most requests is killed (``ray.kill``: its process is gone, as a lost host's would be)."""
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(100, 40000, (n,), generator=g).tolist()
           for n in torch.randint(8, 96, (16,), generator=g).tolist()]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = offline(ids, sp)
    cfg = ClusterConfig(mode="disagg", num_prefill=1, num_decode=2, chunk_size=64, backend="ray")
    killed = []

    async def kill(cl):
        victim = max((i for i in cl.instances.values() if i.role == "decode"), key=lambda i: i.num_requests)
        assert victim.num_requests > 0, "the drill must hit a busy instance"
        local_ray.kill(victim.device.actor, no_restart=True)
        killed.append(victim.id)

    async def run():
        async with Cluster(ENGINE, cfg, bundle=default_bundle_fp32) as cl:
            check(await stream_all(cl, ids, sp, kill, after_tokens=40, timeout=240), want)
            (victim,) = killed
            await settled_on_ray(cl, [i for i in cl.instances if i != victim])
            return cl.instances[victim], list(cl.lifecycle.failure_log), cl.all_counts()

    dead, failures, counts = asyncio.run(run())
    assert dead.state == "failed" and re.search("died|gone", dead.failure), dead.failure  # Ray's watch or the channel
    (failure,) = failures
    assert failure["instance"] == dead.id and failure["requests"] >= 1 and counts["reruns"] >= 1
    assert 0 < failure["recovered_s"] < 60  # the last re-run request streamed again this long after
    print(f"\nkilled {dead.id} holding {failure['requests']} requests: recovered in {failure['recovered_s']:.3f} s")


def test_actor_that_cannot_be_placed_fails_start_with_a_readable_error(local_ray, default_bundle_fp32):
    """An instance asking Ray for what no host has (a GPU here) never starts: the cluster's start
    fails within the actor start timeout, naming what was asked and what is free."""
    from aserve.devices.device import DeviceFault

    cfg = ClusterConfig(mode="coupled", num_coupled=1, backend="ray", actor_start_timeout_s=3)
    cl = Cluster(EngineConfig(dtype="fp32", kv_cache_gb=0.1, device="cuda"), cfg, bundle=default_bundle_fp32)
    with pytest.raises(DeviceFault, match=r"not up within 3 s \(it asks for 1 GPU; free now: 2 CPU, 0 GPU\)"):
        asyncio.run(cl.start())
    assert not cl.started and local_ray.is_initialized()  # the session's Ray is not this cluster's to stop


@pytest.mark.long
def test_the_driver_holds_no_weights(local_ray, offline):
    """A cluster on Ray that loads its own bundle keeps the model's shape and tokenizer only (the
    actors load the weights), and answers as one process does."""
    ids = prompts([9, 40])

    async def run():
        async with Cluster(ENGINE, ClusterConfig(mode="coupled", num_coupled=1, backend="ray")) as cl:
            reqs = await asyncio.gather(*[cl.generate(p, SP) for p in ids])
            return cl.bundle, [r.output_token_ids for r in reqs]

    bundle, got = asyncio.run(run())
    assert bundle.model is None and bundle.kernels == "in the actors" and bundle.tokenizer is not None
    assert got == offline(ids)


def watch(monkeypatch, owner, name: str) -> list:
    """Replace ``owner.name`` by the real function, recording what each call returned: the list."""
    returned, real = [], getattr(owner, name)

    def watched(*args, **kwargs):
        returned.append(real(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(owner, name, watched)
    return returned


def write_trace(path, n: int, gap_s: float, prompt) -> None:
    """A trace of ``n`` requests ``gap_s`` apart, request i's prompt ``prompt(i)`` tokens, 3-6 out."""
    import json

    path.write_text("".join(json.dumps({"timestamp": gap_s * i, "prompt_tokens": prompt(i), "output_tokens": 3 + i % 4})
                            + "\n" for i in range(n)))


@pytest.mark.long
def test_a_replay_whose_systems_all_run_on_ray_loads_no_weights(local_ray, tmp_path, monkeypatch):
    """``replay`` loads the bundle its systems share once; where every system runs on Ray it keeps
    the model's shape and tokenizer only (each actor loads the weights), and the replay serves
    every request through the actors. The loader is the real one, watched for what it returned."""
    import json

    from aserve.commands import main
    from aserve.commands import replay as replay_command

    loaded = watch(monkeypatch, replay_command, "_tokenizer_and_context")
    trace, out = tmp_path / "trace.jsonl", tmp_path / "report.json"
    write_trace(trace, 6, 0.05, lambda i: 24 + 7 * i)
    assert main(["replay", str(trace), "--cluster", "ray", "--mode", "coupled", "--instances", "1", "--dtype", "fp32",
                 "--kv-cache-gb", "0.1", "--predictor", "none", "--no-warmup", "--no-progress", "--json", str(out)]) == 0
    bundle = loaded[0][0]
    assert bundle.model is None and bundle.kernels == "in the actors" and bundle.tokenizer is not None
    (system,) = json.loads(out.read_text())["systems"].values()
    assert system["completed"] == 6 and system["failed"] == system["aborted"] == 0, system


@pytest.mark.long
def test_a_goodput_search_whose_systems_all_run_on_ray_loads_no_weights(local_ray, tmp_path, monkeypatch):
    """``bench goodput`` loads the bundle its systems share once, as ``replay`` does: where every
    system runs on Ray the driver keeps the model's shape and tokenizer only, and each probed rate
    is replayed through the actors. The loader is the real one, watched for what it returned."""
    import json

    from aserve.commands import main
    from aserve.devices import factory

    loaded = watch(monkeypatch, factory, "load_bundle")
    trace, out = tmp_path / "trace.jsonl", tmp_path / "goodput.json"
    write_trace(trace, 20, 0.4, lambda i: 16 + 9 * (i % 5))
    assert main(["bench", "goodput", str(trace), "--device", "cpu", "--cluster", "ray", "--mode", "coupled",
                 "--instances", "1", "--dtype", "fp32", "--kv-cache-gb", "0.1", "--predictor", "none",
                 "--slo", "balanced", "--max-points", "3", "--estimate-device", "sim:opt-13b-v100-32gb",
                 "--no-progress", "--json", str(out)]) == 0
    bundle = loaded[0]
    assert bundle.model is None and bundle.kernels == "in the actors" and bundle.tokenizer is not None
    (system,) = json.loads(out.read_text())["systems"].values()
    assert 1 <= system["num_points"] == len(system["points_detail"]) <= 3, system
    for point in system["points_detail"]:  # each rate replayed whole: every request answered, good or not
        assert 0 <= point["attainment"] <= 1 and point["attainment"] == pytest.approx(point["good"] / 20), point
