"""The Ray device's pieces, without Ray: DeviceHost (the body of an instance's actor, over a tiny
random model) moves the right bytes through export / import / confirm and unpins an export nobody
confirms when its lease runs out; ``--cluster`` parses into ``ClusterConfig.backend``."""
import asyncio
from pathlib import Path

import pytest
import torch

from aserve.config import EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.devices.device_host import DeviceHost
from scheduling.clock import FakeClock
from tests.tiny import LLAMA, hf_model, ours

ENGINE = EngineConfig(dtype="fp32", attention="reference", kv_cache_gb=0.001)


@pytest.fixture(scope="module")
def bundle():
    model = ours(LLAMA, hf_model(LLAMA))
    return ModelBundle(Path("tiny"), model.args, model, None, torch.float32, "cpu")


def host(bundle, name: str, clock=None, lease_s: float = 5.0) -> DeviceHost:
    async def get(ref):
        return ref

    return DeviceHost(name, ENGINE, 1, lease_s, bundle=bundle, put=lambda value: value, get=get, clock=clock)


def test_export_import_confirm_moves_the_blocks(bundle):
    a, b = host(bundle, "p0"), host(bundle, "d1")
    a.device.kv.pool.copy_(torch.randn(a.device.kv.pool.shape))

    src_pool, dst_pool, block_bytes = a.device.kv.pool, b.device.kv.pool, b.device.kv.block_bytes

    async def run():
        refs = await a.export_kv("r", [3, 5, 4])
        assert a.held()["exports"] == {"r": 3 * a.device.kv.block_bytes}
        nbytes = await b.import_kv("r", refs, [7, 1, 2], sender=a)
        await a.close()  # closing lets the pools go: the test keeps its own references
        await b.close()
        return nbytes

    assert asyncio.run(run()) == 3 * block_bytes
    assert torch.equal(dst_pool[:, :, [7, 1, 2]], src_pool[:, :, [3, 5, 4]])
    assert not dst_pool[:, :, [0, 3, 4, 5, 6]].any()  # nothing else written
    assert a.held() == {"exports": {}, "exported": 1, "confirmed": 1, "expired": 0, "imported": 0}
    assert b.held()["imported"] == 1


def test_unconfirmed_export_is_unpinned_when_its_lease_runs_out(bundle):
    clock = FakeClock()
    a = host(bundle, "p0", clock, lease_s=2.0)

    async def run():
        await a.export_kv("lost", [0, 1])
        clock.advance(1.0)
        await a.export_kv("young", [2])
        assert a.expire() == []
        clock.advance(1.5)  # "lost" is 2.5 s old, "young" 1.5 s
        assert a.expire() == ["lost"]
        assert list(a.held()["exports"]) == ["young"]
        assert a.release("lost") is False  # a late confirmation finds nothing
        await a.close()

    asyncio.run(run())
    assert a.held()["expired"] == 1


def test_import_of_the_wrong_size_is_refused(bundle):
    a, b = host(bundle, "p0"), host(bundle, "d1")

    async def run():
        refs = await a.export_kv("r", [0, 1])
        with pytest.raises(ValueError, match="for 3 blocks"):
            await b.import_kv("r", refs, [0, 1, 2], sender=a)
        assert "r" in a.held()["exports"]  # not confirmed: it stays pinned until its lease
        await a.close()
        await b.close()

    asyncio.run(run())
    with pytest.raises(ValueError, match="lease_s"):
        DeviceHost("x", ENGINE, 1, 0.0)


def test_cluster_flag_and_backend_checks():
    from aserve.commands import build_parser
    from aserve.commands.common import cluster_config
    from aserve.config import ClusterConfig

    a = build_parser().parse_args(["replay", "t.jsonl", "--cluster", "ray:10.0.0.1:6379", "--chunk-size", "64"])
    cfg = cluster_config(a)
    assert (cfg.backend, cfg.ray_address) == ("ray:10.0.0.1:6379", "10.0.0.1:6379")
    assert ClusterConfig(backend="ray").ray_address is None and ClusterConfig().backend == "local"
    for bad in ("ray:", "local:x", "dask", "ray: "):
        with pytest.raises(ValueError, match="bad backend"):
            ClusterConfig(backend=bad)
    with pytest.raises(ValueError, match="device_share 'dedicated'"):
        ClusterConfig(backend="ray", device_share="dedicated")
    with pytest.raises(ValueError, match="give --mode disagg, coupled or adaptive"):
        a = build_parser().parse_args(["generate", "hi", "--cluster", "ray"])
        a.func(a)
