"""A Ray cluster of three nodes on this one machine (Ray's own multi-node harness: a head and two
more raylets, each with its own CPUs and its own object store, as `ray start` twice would make):
the prefill actor on the host marked ``aserve_prefill``, one decode actor on each host marked
``aserve_decode`` (``--ray-placement pools``), every hand-over crossing nodes actor to actor
over the direct KV wire, the same greedy tokens as in one process; then one decode host is
removed mid-run, its actor with it, and no request is lost."""
import asyncio
import re

import pytest
import torch

from aserve.cluster.cluster import Cluster
from aserve.config import ClusterConfig, EngineConfig
from aserve.engine.offline import LLM
from scheduling.request import SamplingParams
from tests.cluster_support import check, settled, stream_all
from tests.conftest import init_local_ray

pytestmark = [pytest.mark.slow, pytest.mark.long]
ENGINE = EngineConfig(dtype="fp32", kv_cache_gb=0.1)
SP = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def nodes():
    """Head (1 CPU, marked prefill) and two nodes (1 CPU each, marked decode); the driver (this
    process) joins at the head. The session's local Ray, if up, is started again afterwards."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    from ray.cluster_utils import Cluster as RayNodes

    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    small = 100 * 2**20
    cluster = RayNodes(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"aserve_prefill": 1}, "object_store_memory": small, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1, resources={"aserve_decode": 1}, object_store_memory=small)
               for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)  # the lost raylet's dump
    try:
        yield ray, cluster, workers
    finally:
        ray.shutdown()
        cluster.shutdown()
        if was_up:
            init_local_ray(ray)


def prompts(seed=11, n=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (k,), generator=g).tolist() for k in torch.randint(8, 96, (n,), generator=g).tolist()]


def test_cross_node_hand_overs_and_a_lost_node(nodes, default_bundle_fp32):
    ray, ray_nodes, workers = nodes
    ids = prompts()
    llm = LLM(ENGINE, bundle=default_bundle_fp32)
    want = [c.token_ids for c in llm.generate(ids, SP)]
    # the nodes share this machine's /dev/shm; --ray-kv socket streams as between two hosts
    cfg = ClusterConfig(mode="disagg", num_prefill=1, num_decode=2, chunk_size=64, backend="ray",
                        ray_placement="pools", ray_kv="socket")
    head, decode_nodes = ray_nodes.head_node.node_id, {w.node_id: w for w in workers}
    lost = []

    async def lose_a_node(cl):
        victim = max((i for i in cl.instances.values() if i.role == "decode"), key=lambda i: i.num_requests)
        assert victim.num_requests > 0, "the drill must hit a busy instance"
        await asyncio.to_thread(ray_nodes.remove_node, decode_nodes[victim.device.node_id], False)
        lost.append(victim.id)

    async def run():
        async with Cluster(ENGINE, cfg, bundle=default_bundle_fp32) as cl:
            p0 = next(i for i in cl.instances.values() if i.role == "prefill")
            decodes = [i for i in cl.instances.values() if i.role == "decode"]
            assert p0.device.node_id == head  # the host marked aserve_prefill
            assert {d.device.node_id for d in decodes} == set(decode_nodes)  # one decode actor on each marked host
            # a first wave: every hand-over crosses nodes, actor to actor
            first = await asyncio.gather(*[cl.generate(p, SP) for p in ids[:4]])
            assert [r.output_token_ids for r in first] == want[:4]
            assert p0.device.kv_sent == {"direct": 4, "shared-memory": 0, "object-store": 0}
            # then the drill: a decode host goes away mid-run with its actor
            check(await stream_all(cl, ids, SP, lose_a_node, after_tokens=40, timeout=300), want)
            (victim,) = lost
            await settled(cl, [i for i in cl.instances if i != victim])
            return cl.instances[victim], list(cl.lifecycle.failure_log), cl.all_counts(), p0.device.kv_sent

    dead, failures, counts, sent = asyncio.run(run())
    assert dead.state == "failed" and re.search("died|gone", dead.failure), dead.failure  # Ray's watch or the channel
    (failure,) = failures
    assert failure["instance"] == dead.id and failure["requests"] >= 1 and counts["reruns"] >= 1
    assert sent["object-store"] == 0 and sent["direct"] >= len(ids)
    print(f"\nlost the node of {dead.id} holding {failure['requests']} requests: "
          f"recovered in {failure['recovered_s']:.3f} s; {sent['direct']} hand-overs direct across nodes")
