"""KVLink: the real block copy, the emulated wait, send/recv and read/write, failures.

Most tests run on a FakeClock with a sleep that advances it (exact, instant); the timing tests
use the real clock on a slow profile so each takes 50-200 ms.
"""
import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import netemu.transfer as transfer
from netemu.profiles import KVEmulation, LinkProfile
from netemu.transfer import KVLink, TransferError, block_nbytes
from scheduling.clock import FakeClock, MonotonicClock

L, BLOCK_SIZE, H_KV, D = 2, 4, 2, 8
SLOW = LinkProfile("slow", 1000.0, 0.5)  # fake-clock profile: 1000 B/s, 0.5 s latency


def make_pool(num_blocks: int, dtype=torch.float16, fill: bool = True, device="cpu",
              shape=(L, BLOCK_SIZE, H_KV, D)) -> torch.Tensor:
    """A KV pool [L, 2, num_blocks, block_size, H_kv, D]: random, or zeros (``fill=False``)."""
    l, bs, h, d = shape
    pool = torch.zeros(l, 2, num_blocks, bs, h, d, dtype=dtype, device=device)
    if fill:
        if dtype.is_floating_point:
            pool.copy_(torch.randn(pool.shape))
        else:
            pool.copy_(torch.randint(-100, 100, pool.shape))
    return pool


def fake_link(profile: LinkProfile = SLOW, **kw) -> tuple[KVLink, FakeClock, list[float]]:
    clock, slept = FakeClock(), []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds)
        await asyncio.sleep(0)

    return KVLink(profile, clock, sleep=sleep, **kw), clock, slept


def assert_copied(src, src_ids, dst, dst_ids):
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    others = [b for b in range(dst.shape[2]) if b not in dst_ids]
    assert not dst[:, :, others].any()  # untouched blocks stay zero


async def two_sided(link, rid, src, src_ids, dst, dst_ids, recv_first: bool):
    recv = link.recv(rid, dst, dst_ids)
    send = link.send(rid, src, src_ids)
    if recv_first:
        r, s = await asyncio.gather(recv, send)
    else:
        s, r = await asyncio.gather(send, recv)
    assert r is s and link.pending() == {}
    return r


# ---- correctness of the copy and the byte count ----------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("op", ["write", "read", "send-recv", "recv-send"])
@pytest.mark.parametrize("copies", [1, 2])
def test_copy_moves_the_request_blocks(dtype, op, copies):
    link, _, _ = fake_link(LinkProfile("t", 1e9, 0.0, copies))
    src, dst = make_pool(8, dtype), make_pool(6, dtype, fill=False)
    src_ids, dst_ids = [5, 1, 2], [0, 4, 3]
    if op in ("write", "read"):
        coro = getattr(link, op)("r1", src, src_ids, dst, dst_ids)
    else:
        coro = two_sided(link, "r1", src, src_ids, dst, dst_ids, recv_first=op == "recv-send")
    rec = asyncio.run(coro)
    assert_copied(src, src_ids, dst, dst_ids)
    expected = 3 * L * 2 * BLOCK_SIZE * H_KV * D * src.element_size()
    assert rec.nbytes == expected == 3 * block_nbytes(src) == rec.emulated_nbytes
    assert rec.request_id == "r1" and rec.op == ("send" if "-" in op else op)
    assert link.stats()["bytes"] == expected


@pytest.mark.parametrize("copies", [1, 2])
def test_fragmented_ids_gather_and_scatter(copies):
    # Twelve scattered blocks: too many runs for slice copies, so the gather path runs.
    link, _, _ = fake_link(LinkProfile("t", 1e9, 0.0, copies))
    src, dst = make_pool(16, torch.bfloat16), make_pool(16, torch.bfloat16, fill=False)
    src_ids = [15, 3, 9, 0, 12, 6, 1, 10, 4, 13, 7, 2]
    dst_ids = [1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6]
    assert len(transfer._runs(src_ids, dst_ids)) == 12 > transfer._MAX_SLICE_RUNS
    rec = asyncio.run(link.read("r", src, src_ids, dst, dst_ids))
    assert_copied(src, src_ids, dst, dst_ids)
    assert rec.nbytes == 12 * block_nbytes(src)


def test_runs_coalesce_consecutive_ids():
    assert transfer._runs([4, 5, 6, 0, 1], [10, 11, 12, 13, 2]) == [(4, 10, 3), (0, 13, 1),
                                                                    (1, 2, 1)]
    assert transfer._runs([], []) == []


def test_fake_clock_time_is_exact():
    link, _, slept = fake_link()
    src, dst = make_pool(4, torch.float32), make_pool(4, torch.float32, fill=False)
    rec = asyncio.run(link.write("r", src, [0, 1], dst, [2, 3]))
    assert rec.real_copy_s == 0.0  # the fake clock does not move during the copy
    assert rec.emulated_s == pytest.approx(rec.nbytes / 1000 + 0.5)
    assert rec.model_s == pytest.approx(rec.emulated_s) and not rec.copy_bound
    assert slept == pytest.approx([rec.emulated_s])


def test_emulated_model_charges_its_kv_size():
    emu = KVEmulation.from_args(model="smollm2-135m")
    link, _, _ = fake_link(LinkProfile("t", 1e6, 1e-3), emulation=emu)
    src, dst = make_pool(4), make_pool(4, fill=False)
    rec = asyncio.run(link.write("r", src, [0, 1], dst, [0, 1], num_tokens=7))
    assert rec.emulated_nbytes == 7 * 23040 and rec.nbytes == 2 * block_nbytes(src)
    assert rec.emulated_s == pytest.approx(7 * 23040 / 1e6 + 1e-3)
    rec = asyncio.run(link.write("r", src, [0, 1], dst, [0, 1]))  # default: every slot
    assert rec.emulated_nbytes == 2 * BLOCK_SIZE * 23040


def test_copy_on_an_executor():
    link, _, _ = fake_link()
    src, dst = make_pool(8), make_pool(8, fill=False)
    with ThreadPoolExecutor(1) as pool:
        rec = asyncio.run(link.write("r", src, [7, 3], dst, [1, 2], executor=pool))
    assert_copied(src, [7, 3], dst, [1, 2])
    assert rec.nbytes == 2 * block_nbytes(src)


# ---- real-clock timing -----------------------------------------------------------------------
# Blocks of 64 KiB (fp16, 4 layers, 16 slots, 4 heads of 64); 32 of them = 2 MiB per transfer.
BIG = (4, 16, 4, 64)
BIG_IDS = list(range(32))


def real_link(bw: float, latency: float) -> KVLink:
    return KVLink(LinkProfile("real", bw, latency), MonotonicClock())


def test_real_time_matches_bandwidth_and_latency():
    link = real_link(20e6, 1e-3)  # 2 MiB -> ~106 ms
    src, dst = make_pool(40, shape=BIG), make_pool(40, shape=BIG, fill=False)
    rec = asyncio.run(link.write("r", src, BIG_IDS, dst, BIG_IDS))
    assert rec.nbytes == 2 * 2**20
    want = rec.nbytes / 20e6 + 1e-3
    assert rec.model_s == pytest.approx(want, rel=0.05)  # the emulated time the link charges
    # the wall time waited out: never shorter; on a loaded machine timers may wake a little late
    assert want * 0.99 <= rec.emulated_s <= want * 1.5 + 0.05
    assert rec.end - rec.start == rec.emulated_s
    assert 0 < rec.real_copy_s <= rec.emulated_s and not rec.copy_bound


def test_two_transfers_sharing_take_twice_as_long():
    link = real_link(8e6, 1e-3)  # alone ~263 ms, shared ~525 ms
    src = make_pool(64, shape=BIG)
    dst_a, dst_b = make_pool(32, shape=BIG, fill=False), make_pool(32, shape=BIG, fill=False)

    async def both():
        return await asyncio.gather(link.write("a", src, BIG_IDS, dst_a, BIG_IDS),
                                    link.write("b", src, [i + 32 for i in BIG_IDS], dst_b,
                                               BIG_IDS))

    a, b = asyncio.run(both())
    alone = a.nbytes / 8e6 + 1e-3
    shared = 2 * a.nbytes / 8e6 + 1e-3
    for rec in (a, b):
        assert rec.model_s == pytest.approx(shared, rel=0.10)  # each got half the bandwidth
        assert rec.model_s > 1.5 * alone
        assert shared * 0.9 <= rec.emulated_s <= shared * 1.5 + 0.05  # wall: late timers allowed
    assert torch.equal(dst_b, src[:, :, 32:])
    s = link.stats()
    assert (s["num_done"], s["in_flight"], s["bytes"]) == (2, 0, 2 * a.nbytes)
    assert s["emulated_s"] == pytest.approx(a.emulated_s + b.emulated_s)


def test_spin_lands_short_transfers_on_time():
    # A 2 ms link time: a plain timer may land up to 1 ms late; the spin lands within µs.
    link = KVLink(LinkProfile("short", 32e6, 0.0), MonotonicClock(), spin_s=3e-3)
    src, dst = make_pool(4, shape=BIG), make_pool(4, shape=BIG, fill=False)
    errors = []
    for _ in range(5):
        rec = asyncio.run(link.write("r", src, [0], dst, [1]))
        errors.append(rec.emulated_s - rec.nbytes / 32e6)
    assert 0 <= min(errors) < 2e-4
    with pytest.raises(ValueError, match="spin_s"):
        KVLink(SLOW, FakeClock(), spin_s=-1)


def test_slow_copy_is_not_hidden():
    # The link is absurdly fast: the real copy dominates, nothing is waited, the record says so.
    slept = []

    async def sleep(seconds):
        slept.append(seconds)

    link = KVLink(LinkProfile("fast", 1e15, 0.0), MonotonicClock(), sleep=sleep)
    src, dst = make_pool(32, shape=BIG), make_pool(32, shape=BIG, fill=False)
    rec = asyncio.run(link.write("r", src, BIG_IDS, dst, BIG_IDS))
    assert rec.real_copy_s > 0 and rec.copy_bound
    assert rec.emulated_s >= rec.real_copy_s > rec.model_s
    assert slept == [] and link.stats()["num_copy_bound"] == 1



def test_carry_charges_the_link_for_a_copy_made_elsewhere():
    """A copy between two processes (a Ray hand-over) is timed by the caller; the link adds the
    emulated wait on top of it and counts it like any write, failures included."""
    link, clock, slept = fake_link()

    async def remote_copy() -> float:  # 0.2 s of real copy, on the link's clock
        clock.advance(0.2)
        return 0.2

    rec = asyncio.run(link.carry("r", 3000, 30, remote_copy))
    assert (rec.nbytes, rec.emulated_nbytes, rec.op) == (3000, 3000, "write")
    assert rec.real_copy_s == pytest.approx(0.2)
    assert rec.emulated_s == pytest.approx(3000 / 1000 + 0.5)  # the link's time: the copy hides in it
    assert slept == pytest.approx([rec.emulated_s - 0.2]) and not rec.copy_bound

    async def lost() -> float:
        raise TransferError("r: the sender died")

    with pytest.raises(TransferError, match="sender died"):
        asyncio.run(link.carry("r", 10, 1, lost))
    s = link.stats()
    assert (s["bytes"], s["real_copy_s"], s["num_failed"], s["in_flight"]) == (3000, pytest.approx(0.2), 1, 0)
    with pytest.raises(ValueError, match="nbytes"):
        asyncio.run(link.carry("r", -1, 1, remote_copy))

# ---- failures leave the link consistent --------------------------------------------------------

@pytest.mark.parametrize("src_ids, dst_ids, dst_dtype, match", [
    ([0, 9], [0, 1], torch.float16, "src block id 9 out of range"),
    ([0, 1], [0, -1], torch.float16, "dst block id -1 out of range"),
    ([0, 1], [2, 2], torch.float16, "duplicate dst block ids"),
    ([0, 1], [2], torch.float16, "2 src blocks, 1 dst blocks"),
    ([0], [0], torch.float32, "dtype"),
])
def test_bad_transfer_raises_and_leaves_nothing_in_flight(src_ids, dst_ids, dst_dtype, match):
    link, _, _ = fake_link()
    src, dst = make_pool(4), make_pool(4, dst_dtype, fill=False)
    with pytest.raises(TransferError, match=match):
        asyncio.run(link.write("r7", src, src_ids, dst, dst_ids))
    s = link.stats()
    assert (s["in_flight"], s["num_failed"], s["bytes"]) == (0, 1, 0)
    assert not dst.any()


def test_failed_copy_is_a_transfer_error(monkeypatch):
    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(transfer, "copy_blocks", broken)
    link, _, _ = fake_link()
    with pytest.raises(TransferError, match="r7.*copy failed: device lost"):
        asyncio.run(link.write("r7", make_pool(2), [0], make_pool(2), [1]))
    s = link.stats()
    assert (s["in_flight"], s["num_aborted"], s["num_failed"]) == (0, 1, 1)


def test_cancel_during_the_wait_frees_the_link():
    async def forever(seconds):
        await asyncio.Event().wait()

    link = KVLink(SLOW, FakeClock(), sleep=forever)

    async def run():
        task = asyncio.create_task(link.write("r", make_pool(2), [0], make_pool(2), [1]))
        await asyncio.sleep(0)
        assert link.model.in_flight() == (0,)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert link.model.in_flight() == () and link.stats()["num_aborted"] == 1


def test_stalled_transfer_lands_late_and_a_timeout_cancels_it():
    """``stall_next``: the copy lands whole, then the transfer hangs the stall on top of the link
    time; a caller's timeout shorter than that cancels it and leaves nothing on the link."""
    link, _, slept = fake_link()
    link.stall_next(1, 10.0)
    src, dst = make_pool(4, torch.float32), make_pool(4, torch.float32, fill=False)
    rec = asyncio.run(link.write("r", src, [0, 1], dst, [2, 3]))
    assert slept[0] == 10.0 and rec.emulated_s == pytest.approx(10.0)  # the link time ran out meanwhile
    assert_copied(src, [0, 1], dst, [2, 3])
    rec = asyncio.run(link.write("r", src, [0], dst, [0]))  # one stall only: the next one is on time
    assert rec.emulated_s == pytest.approx(rec.model_s)

    stuck = KVLink(LinkProfile("fast", 1e12, 0.0), MonotonicClock())  # on time: well under 0.2 s
    stuck.stall_next(1, 30.0)

    async def timed_out():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stuck.write("r", make_pool(2), [0], make_pool(2), [1]), 0.2)
        await asyncio.wait_for(stuck.write("r", make_pool(2), [0], make_pool(2), [1]), 0.2)
    asyncio.run(timed_out())
    assert stuck.model.in_flight() == () and stuck.stats()["num_failed"] == 1
    with pytest.raises(ValueError, match="n and seconds"):
        link.stall_next(1, -1.0)


# ---- two-sided matching --------------------------------------------------------------------

def test_two_sided_errors_and_cancel():
    link, _, _ = fake_link()
    src, dst = make_pool(4), make_pool(4, fill=False)

    async def run():
        first = asyncio.create_task(link.send("r", src, [0]))
        await asyncio.sleep(0)
        assert link.pending() == {"r": "send"}
        with pytest.raises(TransferError, match="already posted"):
            await link.send("r", src, [1])
        # A bad recv fails both sides: the sender hears the same error.
        with pytest.raises(TransferError, match="out of range"):
            await link.recv("r", dst, [99])
        with pytest.raises(TransferError, match="out of range"):
            await first
        # A post cancelled before its match withdraws itself.
        lonely = asyncio.create_task(link.recv("q", dst, [0]))
        await asyncio.sleep(0)
        lonely.cancel()
        with pytest.raises(asyncio.CancelledError):
            await lonely
        assert link.pending() == {}

    asyncio.run(run())
    assert link.stats()["in_flight"] == 0 and not dst.any()


@pytest.mark.gpu
@pytest.mark.parametrize("copies", [1, 2])
def test_cuda_device_to_device(copies):
    link, _, _ = fake_link(LinkProfile("t", 1e9, 0.0, copies))
    last = f"cuda:{torch.cuda.device_count() - 1}"
    src, dst = make_pool(32, device="cuda:0"), make_pool(32, device=last, fill=False)
    src_ids, dst_ids = torch.randperm(32)[:20].tolist(), torch.randperm(32)[:20].tolist()
    for ids in (([3, 4], [0, 7]), (src_ids, dst_ids)):  # slice path, then gather path
        dst.zero_()
        with ThreadPoolExecutor(1) as pool:
            rec = asyncio.run(link.write("r", src, ids[0], dst, ids[1], executor=pool))
        assert_copied(src.cpu(), ids[0], dst.cpu(), ids[1])
        assert rec.nbytes == len(ids[0]) * block_nbytes(src)
