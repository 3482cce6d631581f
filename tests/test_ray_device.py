"""The Ray device's pieces, without Ray: DeviceHost (the body of an instance's actor, over a tiny
random model) moves the right bytes through export / import / confirm and unpins an export nobody
confirms when its lease runs out; ``--cluster`` parses into ``ClusterConfig.backend``."""
import asyncio
import time
from pathlib import Path

import numpy as np

import pytest
import torch

from aserve.config import EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.devices import kv_wire
from aserve.devices.device_host import DeviceHost
from scheduling.clock import FakeClock
from tests.tiny import LLAMA, hf_model, ours

ENGINE = EngineConfig(dtype="fp32", attention="reference", kv_cache_gb=0.001)
needs_shm = pytest.mark.skipif(kv_wire.shm_host_key() is None, reason="no /dev/shm here")


@pytest.fixture(scope="module")
def bundle():
    model = ours(LLAMA, hf_model(LLAMA))
    return ModelBundle(Path("tiny"), model.args, model, None, torch.float32, "cpu")


def host(bundle, name: str, clock=None, lease_s: float = 5.0, token=None) -> DeviceHost:
    async def get(ref):
        return ref

    return DeviceHost(name, ENGINE, 1, lease_s, bundle=bundle, put=lambda value: value.copy(), get=get, clock=clock,
                      wire_token=token, wire_host="127.0.0.1")


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
    assert a.held() == {"exports": {}, "exported": 1, "confirmed": 1, "expired": 0, "imported": 0, "pushed": 0,
                        "received": 0}
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


def test_push_moves_the_blocks_straight_into_the_other_pool(bundle):
    """The direct transport: p0 streams three blocks to d1's wire server, which has them in its
    pool when the push returns; nothing is pinned on either side. Twice over one connection."""
    a, b = host(bundle, "p0", token="t0k"), host(bundle, "d1", token="t0k")
    a.device.kv.pool.copy_(torch.randn(a.device.kv.pool.shape))
    src_pool, dst_pool, block_bytes = a.device.kv.pool, b.device.kv.pool, b.device.kv.block_bytes

    async def run():
        pushed = [await a.push_kv("r", [3, 5, 4], b.wire.address, [7, 1, 2], shared=False),
                  await a.push_kv("s", [0], b.wire.address, [6], shared=False)]
        assert [p["via"] for p in pushed] == ["socket", "socket"]
        sent = sum(p["bytes"] for p in pushed)
        assert a.held()["exports"] == {} and b.held()["exports"] == {}
        counts = (a.held()["pushed"], b.held()["received"], b.wire.counts["received"])
        await a.close()
        await b.close()
        return sent, counts

    sent, counts = asyncio.run(run())
    assert sent == 4 * block_bytes and counts == (2, 2, 2)
    assert torch.equal(dst_pool[:, :, [7, 1, 2, 6]], src_pool[:, :, [3, 5, 4, 0]])
    assert not dst_pool[:, :, [0, 3, 4, 5]].any()  # nothing else written


@needs_shm
def test_on_one_host_a_push_goes_through_shared_memory(bundle):
    """Two hosts seeing one /dev/shm: p0 gathers into a segment of its own and names it; d1 copies
    from there, so no payload crosses the socket. A receiver that cannot map the segment (here:
    its address does not carry the key, as another host's would not) is streamed to instead.
    Closing removes the segments."""
    a, b = host(bundle, "p0", token="t0k"), host(bundle, "d1", token="t0k")
    a.device.kv.pool.copy_(torch.randn(a.device.kv.pool.shape))
    src_pool, dst_pool = a.device.kv.pool, b.device.kv.pool
    assert len(b.wire.address) == 3 and a._sender.can_share(b.wire.address)

    async def run():
        pushed = [await a.push_kv("r", [3, 5, 4], b.wire.address, [7, 1, 2]),
                  await a.push_kv("s", [0, 1], b.wire.address, [0, 3]),  # the same segment, mapped once
                  await a.push_kv("t", [2], b.wire.address[:2], [4])]  # no key: streamed
        segments = set(a._shared.files())
        held = a.held()["pushed via"]
        await a.close()
        await b.close()
        return pushed, segments, held

    pushed, segments, held = asyncio.run(run())
    assert [p["via"] for p in pushed] == ["shared memory", "shared memory", "socket"]
    assert held == {"shared memory": 2, "socket": 1}
    assert torch.equal(dst_pool[:, :, [7, 1, 2, 0, 3, 4]], src_pool[:, :, [3, 5, 4, 0, 1, 2]])
    assert not dst_pool[:, :, [5, 6]].any()
    assert len(segments) == 1  # one segment served every push, and is gone after close
    assert not any(Path(kv_wire.SHM_DIR, n).exists() for n in segments)


@needs_shm
def test_a_segment_the_receiver_cannot_map_is_streamed_and_no_path_is_opened(bundle, tmp_path):
    """A header naming anything but a sender's segment (a path, a name of another form, one that
    does not exist) is not opened: the receiver asks for the bytes on the socket, and the sender
    streams to it from then on."""
    mapped = kv_wire._Mapped()
    secret = tmp_path / "secret"
    secret.write_bytes(b"\x07" * 4096)
    for name in (str(secret), "../" * 8 + str(secret)[1:], "aserve-kv-1-000000000000", "other"):
        assert mapped.view(name, 16) is None
    b = host(bundle, "d1", token="t0k")
    sender = kv_wire.KVWireSender("t0k")
    data = np.full(b.device.kv.block_bytes, 3, dtype=np.uint8)
    assert sender.push(b.wire.address, "x", [1], data, shm="aserve-kv-1-000000000000") == (data.nbytes, "socket")
    assert not sender.can_share(b.wire.address)  # refused once: streamed from then on
    sender.close()
    assert b.device.kv.pool[:, :, 1].contiguous().view(torch.uint8).eq(3).all()  # the bytes as sent
    asyncio.run(b.close())


@needs_shm
def test_shared_staging_keeps_only_its_largest_segments():
    """Pushes that grow make new segments: the ones neither kept nor lent out are removed at once,
    so /dev/shm holds at most ``keep`` of them plus those in use."""
    staging = kv_wire.SharedStaging(keep=2)
    made = set()
    for mb in (1, 2, 3, 5, 9, 17):  # each needs a segment larger than any before it
        buf = staging.take(mb << 20)
        made.add(staging.name_of(buf))
        held = staging.take(1 << 20)  # a second one lent out meanwhile: never removed while in use
        assert Path(kv_wire.SHM_DIR, staging.name_of(held)).exists()
        staging.give(held)
        staging.give(buf)
        live = [n for n in made | set(staging.files()) if Path(kv_wire.SHM_DIR, n).exists()]
        assert sorted(live) == sorted(staging.files()) and len(live) <= 2
    staging.close()
    assert not any(Path(kv_wire.SHM_DIR, n).exists() for n in made)


@needs_shm
def test_a_killed_sender_leaves_no_segment_behind():
    """A process killed while it holds segments: multiprocessing's resource tracker removes them."""
    import signal
    import subprocess
    import sys


    code = ("import sys, time; from aserve.devices.kv_wire import SharedStaging; s = SharedStaging(); "
            "b = s.take(3 << 20); b[:] = 1; print(s.name_of(b), flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    name = proc.stdout.readline().strip()
    path = Path(kv_wire.SHM_DIR, name)
    assert kv_wire.SHM_NAME.fullmatch(name) and path.stat().st_size == 4 << 20  # rounded up to a power of two
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for _ in range(100):
        if not path.exists():
            break
        time.sleep(0.05)
    assert not path.exists()


def test_push_is_refused_with_a_readable_error_and_writes_nothing(bundle):
    """A wrong size, a block outside the pool, a stranger without the cluster's token: each push
    raises WireError naming why, and the receiver's pool is untouched."""
    from aserve.devices.kv_wire import KVWireSender, WireError

    a, b = host(bundle, "p0", token="t0k"), host(bundle, "d1", token="t0k")
    a.device.kv.pool.fill_(1.0)
    n, pool = b.device.num_blocks, b.device.kv.pool

    async def run():
        with pytest.raises(WireError, match=rf"blocks \[{n}\] are outside this pool of {n}"):
            await a.push_kv("r", [0], b.wire.address, [n])
        with pytest.raises(WireError, match="bytes pushed for 1 blocks"):
            await a.push_kv("r", [0, 1], b.wire.address, [0])
        stranger = KVWireSender("guess")
        data = np.ones(b.device.kv.block_bytes, dtype=np.uint8)
        with pytest.raises(WireError, match="did not present the cluster's token"):
            await asyncio.to_thread(stranger.push, b.wire.address, "x", [0], data)
        stranger.close()
        await a.push_kv("ok", [0], b.wire.address, [1])  # the receiver serves on after refusals
        refused = b.wire.counts["refused"]
        await a.close()
        await b.close()
        return refused

    assert asyncio.run(run()) == 3
    assert pool[:, :, 1].eq(1.0).all() and not pool[:, :, [0] + list(range(2, n))].any()
    with pytest.raises(RuntimeError, match="without a KV wire"):
        asyncio.run(host(bundle, "x").push_kv("r", [0], ("127.0.0.1", 1), [0]))


def test_a_push_cut_short_writes_nothing(bundle):
    """A sender that dies mid-payload: the receiver drops the partial bytes and serves on."""
    import json
    import socket

    from aserve.devices.kv_wire import LENGTH

    b = host(bundle, "d1", token="t0k")
    nbytes, pool = 2 * b.device.kv.block_bytes, b.device.kv.pool
    with socket.create_connection(b.wire.address[:2]) as s:
        head = json.dumps({"token": "t0k", "request": "cut", "blocks": [0, 1], "nbytes": nbytes}).encode()
        s.sendall(LENGTH.pack(len(head)) + head)
        s.recv(64)  # the go-ahead
        s.sendall(b"\x01" * (nbytes // 2))
    for _ in range(200):
        if b.wire.counts["broken"]:
            break
        time.sleep(0.01)
    assert b.wire.counts == {"received": 0, "refused": 0, "broken": 1}
    assert not pool.any()
    asyncio.run(b.close())


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
    a = build_parser().parse_args(["replay", "t.jsonl", "--cluster", "ray", "--ray-kv", "object-store",
                                   "--ray-placement", "pools"])
    assert (cluster_config(a).ray_kv, cluster_config(a).ray_placement) == ("object-store", "pools")
    assert (ClusterConfig().ray_kv, ClusterConfig().ray_placement) == ("direct", "auto")
    with pytest.raises(ValueError, match="bad ray_kv 'nccl': direct or socket or object-store"):
        ClusterConfig(backend="ray", ray_kv="nccl")
    with pytest.raises(ValueError, match="bad ray_placement 'strict': choose one of auto, pools, spread, pack"):
        ClusterConfig(backend="ray", ray_placement="strict")
    with pytest.raises(ValueError, match="give --mode disagg, coupled or adaptive"):
        a = build_parser().parse_args(["generate", "hi", "--cluster", "ray"])
        a.func(a)
