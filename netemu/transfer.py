"""The unified KV transfer API: a real copy between pools, throttled to an emulated link.

Every instance owns one KV pool; a transfer moves one request's blocks between two pools:

```
 pool: [L, 2, num_blocks, block_size, H_kv, D]      L layers; 2 = K, V
                 └── block b is pool[:, :, b]: [L, 2, block_size, H_kv, D]

 dst_pool[:, :, dst_block_ids] = src_pool[:, :, src_block_ids]
   direct   (1 copy):  src device ─────────────────► dst device
   indirect (2 copies): src device ─► host buffer ─► dst device
```

Time line of one transfer (``LinkModel`` gives the landing time, shared with the others):

```
 start ── real copy ──┬── sleep the rest ── end       end = max(copy end, link landing time)
                      └ copy slower than the link? no sleep; the record shows real > model
```

The real copy is never hidden: the emulated time only adds waiting on top of it. Two styles,
as RDMA verbs: two-sided ``send``/``recv`` (both sides post; matched by request id) and
one-sided ``write`` (the sender pushes) / ``read`` (the receiver pulls). Only the event-loop
thread calls these; the copy itself may run on an executor so the loop stays responsive.
``carry`` charges the same link for a copy made elsewhere (between two processes).
"""
from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence

import torch

from netemu.link import LinkModel
from netemu.profiles import KVEmulation, LinkProfile
from scheduling.clock import Clock

Sleep = Callable[[float], Awaitable[None]]


class TransferError(RuntimeError):
    """A transfer that could not happen: bad block ids, mismatched pools, a failed copy."""


@dataclass(frozen=True)
class TransferRecord:
    """What one transfer did. Times are on the link's clock; ``emulated_s = end - start``."""

    request_id: str
    nbytes: int  # real bytes copied: num blocks x block bytes
    emulated_nbytes: int  # bytes the link was charged (a bigger model's KV, or the real ones)
    real_copy_s: float
    emulated_s: float
    start: float
    end: float
    model_s: float = 0.0  # the link model's duration alone (sharing included)
    op: str = "write"  # send | read | write

    def __post_init__(self):
        assert self.nbytes >= 0 and self.emulated_nbytes >= 0
        assert self.real_copy_s >= 0 and self.model_s >= 0
        assert self.end >= self.start and self.op in ("send", "read", "write"), self
        # The copy happens inside [start, end]: it can never be hidden by the emulation.
        assert self.emulated_s + 1e-9 >= self.real_copy_s, self

    @property
    def copy_bound(self) -> bool:
        """True when the real copy was slower than the emulated link (no wait happened)."""
        return self.real_copy_s > self.model_s


def block_nbytes(pool: torch.Tensor) -> int:
    """Bytes of one block of ``pool`` (all layers, K and V)."""
    L, two, _, block_size, h_kv, d = pool.shape
    return L * two * block_size * h_kv * d * pool.element_size()


def check_blocks(request_id: str, src_pool: torch.Tensor, src_block_ids: Sequence[int],
                 dst_pool: torch.Tensor, dst_block_ids: Sequence[int]) -> None:
    """Raise ``TransferError`` unless the copy is well formed. Ints only: cheap, no device sync."""
    where = f"request {request_id!r}"
    for name, pool in (("src", src_pool), ("dst", dst_pool)):
        if pool.dim() != 6 or pool.shape[1] != 2:
            raise TransferError(f"{where}: {name} pool shape {tuple(pool.shape)} is not "
                                "[L, 2, num_blocks, block_size, H_kv, D]")
    if src_pool.dtype != dst_pool.dtype:
        raise TransferError(f"{where}: dtype {src_pool.dtype} -> {dst_pool.dtype}")
    s, d = list(src_pool.shape), list(dst_pool.shape)
    if s[:2] + s[3:] != d[:2] + d[3:]:
        raise TransferError(f"{where}: block shapes differ, {tuple(s)} vs {tuple(d)}")
    if len(src_block_ids) != len(dst_block_ids):
        raise TransferError(f"{where}: {len(src_block_ids)} src blocks, "
                            f"{len(dst_block_ids)} dst blocks")
    for name, ids, num_blocks in (("src", src_block_ids, s[2]), ("dst", dst_block_ids, d[2])):
        bad = [b for b in ids if not isinstance(b, int) or not 0 <= b < num_blocks]
        if bad:
            raise TransferError(f"{where}: {name} block id {bad[0]!r} out of range "
                                f"[0, {num_blocks})")
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise TransferError(f"{where}: duplicate dst block ids {list(dst_block_ids)}")


# On one device, up to this many runs of consecutive ids copy slice by slice: no temporary,
# one strided copy per run. More fragmented lists, and every copy between devices, gather into
# a contiguous temporary and scatter: on an H100 box one strided block crossed to pinned host
# memory at ~10 GB/s, the same block made contiguous first at ~22 GB/s.
_MAX_SLICE_RUNS = 8


def _runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` of maximal runs consecutive on both sides."""
    runs: list[list[int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def _as_slice(ids: Sequence[int]) -> Optional[slice]:
    """``ids`` as a slice when they are consecutive: indexing with it makes a view, no copy."""
    if ids and list(ids) == list(range(ids[0], ids[0] + len(ids))):
        return slice(ids[0], ids[0] + len(ids))
    return None


def _move(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor,
          dst_ids: Sequence[int], non_blocking: bool) -> None:
    """``dst[:, :, dst_ids] = src[:, :, src_ids]`` across devices.

    Index work happens on the device that holds the ids' pool; only contiguous data crosses
    devices, so a pinned staging buffer is read or written in place, never via a pageable temp.
    """
    runs = _runs(src_ids, dst_ids)
    if src.device == dst.device and len(runs) <= _MAX_SLICE_RUNS:
        for s, d, n in runs:
            dst[:, :, d:d + n].copy_(src[:, :, s:s + n], non_blocking=non_blocking)
        return
    src_run, dst_run = _as_slice(src_ids), _as_slice(dst_ids)
    if src_run is not None:
        blocks = src[:, :, src_run]  # a view: [L, 2, n, block_size, H_kv, D]
    else:
        src_idx = torch.tensor(src_ids, dtype=torch.long, device=src.device)
        blocks = src.index_select(2, src_idx)  # gathered: [L, 2, n, block_size, H_kv, D]
    if dst_run is not None:
        dst[:, :, dst_run].copy_(blocks, non_blocking=non_blocking)
    else:
        dst_idx = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
        dst.index_copy_(2, dst_idx, blocks.to(dst.device, non_blocking=non_blocking))


def copy_blocks(src_pool: torch.Tensor, src_block_ids: Sequence[int], dst_pool: torch.Tensor,
                dst_block_ids: Sequence[int], num_copies: int = 1,
                host_buffer: Optional[torch.Tensor] = None) -> None:
    """The real copy; returns when the bytes are in ``dst_pool`` (CUDA streams synchronized).

    ``num_copies >= 2`` bounces once through a host staging tensor, as the indirect path does:
    ``host_buffer`` (flat uint8, pinned when CUDA is involved) if given, else a fresh one.
    """
    if num_copies == 1:
        _move(src_pool, src_block_ids, dst_pool, dst_block_ids, non_blocking=True)
    else:
        shape = (*src_pool.shape[:2], len(src_block_ids), *src_pool.shape[3:])
        nbytes = len(src_block_ids) * block_nbytes(src_pool)
        if host_buffer is None:
            pin = src_pool.is_cuda or dst_pool.is_cuda
            host_buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        host = host_buffer[:nbytes].view(src_pool.dtype).view(shape)
        staged = range(len(src_block_ids))
        # Hop 1 blocks: the host copy must be complete before hop 2 reads it on another stream.
        _move(src_pool, src_block_ids, host, staged, non_blocking=False)
        _move(host, staged, dst_pool, dst_block_ids, non_blocking=True)
    for dev in {src_pool.device, dst_pool.device}:
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()


class _BounceBuffers:
    """Pinned host buffers for the indirect path, reused: pinning costs ms per MB, so a fresh
    one per transfer would make the real copy, not the link, the bottleneck. Taken and given
    back on the event-loop thread only, so a buffer serves one copy at a time."""

    def __init__(self, max_kept: int = 4):
        self.max_kept = max_kept
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        fits = [b for b in self._free if b.numel() >= nbytes]
        if fits:
            buf = min(fits, key=torch.Tensor.numel)
            self._free.remove(buf)
            return buf
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        self._free.append(buf)
        self._free.sort(key=torch.Tensor.numel)
        del self._free[:-self.max_kept]  # keep the largest ones


@dataclass
class _Post:
    """One side of a two-sided transfer, waiting for its match."""

    side: str  # "send" | "recv"
    pool: torch.Tensor
    block_ids: Sequence[int]
    num_tokens: Optional[int]
    executor: Optional[Executor]
    done: asyncio.Future


def _one_sided(op: str, doc: str):
    """``KVLink.write`` and ``KVLink.read``: the same call, named ``op`` in the record (the
    emulated link moves the blocks the same way whichever side drives it)."""
    async def transfer(self: KVLink, request_id: str, src_pool: torch.Tensor,
                       src_block_ids: Sequence[int], dst_pool: torch.Tensor,
                       dst_block_ids: Sequence[int], *, num_tokens: Optional[int] = None,
                       executor: Optional[Executor] = None) -> TransferRecord:
        return await self._transfer(op, request_id, src_pool, src_block_ids, dst_pool,
                                    dst_block_ids, num_tokens, executor)
    transfer.__name__, transfer.__qualname__, transfer.__doc__ = op, f"KVLink.{op}", doc
    return transfer


class KVLink:
    """One emulated interconnect that instances' KV transfers share.

    ``emulation`` charges the link for a bigger model's KV; ``sleep`` and ``clock`` are
    injected (tests pass a ``FakeClock`` and a sleep that advances it); ``executor`` runs the
    copies (``None``: inline on the loop thread), each call may name its own.

    Event-loop timers are millisecond-grained (epoll rounds up), so a sleep lands up to 1 ms
    late: noise on a 100 ms link, most of a 0.3 ms NVLink transfer. ``spin_s > 0`` spends the
    last ``spin_s`` of each wait yielding (``sleep(0)``) until the clock passes the landing
    time: about 1e-3 gives µs-accurate ends at the cost of a busy loop thread meanwhile.
    Keep it 0 with a ``FakeClock``, which never moves by itself.
    """

    def __init__(self, profile: LinkProfile, clock: Clock, *,
                 emulation: KVEmulation = KVEmulation(), sleep: Sleep = asyncio.sleep,
                 executor: Optional[Executor] = None, spin_s: float = 0.0):
        if spin_s < 0:
            raise ValueError(f"spin_s must be >= 0, got {spin_s!r}")
        self.profile = profile
        self.clock = clock
        self.emulation = emulation
        self.model = LinkModel(profile, clock)
        self._sleep = sleep
        self.spin_s = spin_s
        self._executor = executor
        self._ids = itertools.count()
        self._posted: dict[str, _Post] = {}
        self._bounce = _BounceBuffers()
        self._totals = {"bytes": 0, "emulated_bytes": 0, "real_copy_s": 0.0,
                        "emulated_s": 0.0, "num_failed": 0, "num_copy_bound": 0}
        self._faults = 0  # fault drills: this many coming transfers fail after starting
        self._stalls: list[float] = []  # fault drills: extra seconds the coming transfers hang

    def fail_next(self, n: int = 1) -> None:
        """Fault drill: ``n`` more of the coming transfers raise ``TransferError`` mid-way, as
        a link error would (the link model is charged and cleaned up like for a real failure)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._faults += n

    def stall_next(self, n: int = 1, seconds: float = 1.0) -> None:
        """Fault drill: ``n`` more of the coming transfers hang ``seconds`` after their copy
        has landed, before the link time runs out, as a congested or stuck link would: a
        caller's timeout shorter than that cancels them (the copy is whole by then)."""
        if n < 0 or seconds < 0:
            raise ValueError(f"n and seconds must be >= 0, got {n}, {seconds}")
        self._stalls += [seconds] * n

    write = _one_sided("write", "One-sided push by the sender into blocks the receiver already allocated.")
    read = _one_sided("read", "One-sided pull by the receiver from blocks the sender still holds.")

    async def send(self, request_id: str, src_pool: torch.Tensor, src_block_ids: Sequence[int],
                   *, num_tokens: Optional[int] = None,
                   executor: Optional[Executor] = None) -> TransferRecord:
        """Post the sender's blocks; returns when the matching ``recv`` has them."""
        return await self._rendezvous(request_id, "send", src_pool, src_block_ids,
                                      num_tokens, executor)

    async def recv(self, request_id: str, dst_pool: torch.Tensor, dst_block_ids: Sequence[int],
                   *, executor: Optional[Executor] = None) -> TransferRecord:
        """Post the receiver's allocated blocks; returns when the ``send``'s KV is in them."""
        return await self._rendezvous(request_id, "recv", dst_pool, dst_block_ids, None, executor)

    async def emulate(self, request_id: str, num_tokens: int, nbytes: int) -> TransferRecord:
        """A transfer with no bytes moved: a simulated device's KV of ``num_tokens`` tokens that
        would weigh ``nbytes``; the link is charged (``emulation`` may say otherwise) and shared
        with the other transfers as ever, and the wait is all the record shows."""
        return await self._charge("write", request_id, 0, num_tokens, None, self.emulation.nbytes(num_tokens, nbytes))

    def pending(self) -> dict[str, str]:
        """Two-sided posts still waiting for their match: request id -> side."""
        return {rid: post.side for rid, post in self._posted.items()}

    def stats(self) -> dict[str, float]:
        """Totals for metrics. ``bytes`` are real, ``emulated_bytes`` what the link was charged;
        ``num_failed`` counts transfers that raised (bad ids, copy errors, cancellations);
        ``busy_s`` is link time with data moving (divide by wall time for utilisation)."""
        m = self.model.stats()
        return {**self._totals, "num_done": m["num_done"], "num_aborted": m["num_aborted"],
                "in_flight": m["in_flight"], "sharing": m["sharing"], "busy_s": m["busy_s"],
                "pending": len(self._posted)}

    async def _rendezvous(self, request_id: str, side: str, pool: torch.Tensor,
                          block_ids: Sequence[int], num_tokens: Optional[int],
                          executor: Optional[Executor]) -> TransferRecord:
        """The first side to arrive waits; the second one runs the transfer for both."""
        post = _Post(side, pool, block_ids, num_tokens, executor,
                     asyncio.get_running_loop().create_future())
        other = self._posted.get(request_id)
        if other is None or other.done.done():  # done already: a waiter cancelled just now
            self._posted[request_id] = post
            try:
                return await post.done
            finally:  # cancelled before a match: withdraw the post
                if self._posted.get(request_id) is post:
                    del self._posted[request_id]
        if other.side == side:
            raise TransferError(f"request {request_id!r}: a {side} is already posted")
        del self._posted[request_id]
        snd, rcv = (post, other) if side == "send" else (other, post)
        try:
            record = await self._transfer("send", request_id, snd.pool, snd.block_ids, rcv.pool,
                                          rcv.block_ids, snd.num_tokens,
                                          snd.executor or rcv.executor)
        except BaseException as e:
            if not other.done.done():
                other.done.set_exception(e if isinstance(e, TransferError) else TransferError(
                    f"request {request_id!r}: the matching {side} was cancelled"))
            raise
        if not other.done.done():
            other.done.set_result(record)
        return record

    async def _transfer(self, op: str, request_id: str, src_pool: torch.Tensor,
                        src_block_ids: Sequence[int], dst_pool: torch.Tensor,
                        dst_block_ids: Sequence[int], num_tokens: Optional[int],
                        executor: Optional[Executor]) -> TransferRecord:
        try:
            check_blocks(request_id, src_pool, src_block_ids, dst_pool, dst_block_ids)
        except TransferError:
            self._totals["num_failed"] += 1
            raise
        nbytes = len(src_block_ids) * block_nbytes(src_pool)
        if num_tokens is None:
            num_tokens = len(src_block_ids) * src_pool.shape[3]
        return await self._charge(op, request_id, nbytes, num_tokens, lambda: self._copy(
            request_id, src_pool, src_block_ids, dst_pool, dst_block_ids, executor or self._executor))

    async def carry(self, request_id: str, nbytes: int, num_tokens: int,
                    copy: Callable[[], Awaitable[float]]) -> TransferRecord:
        """A one-sided write whose real copy happens elsewhere (between two processes, through
        Ray's object store): ``copy()`` moves the ``nbytes`` and returns the seconds it took on
        the link's clock (``self.clock``: the record checks the copy is never hidden), and
        the link charges and waits out the emulated time around it exactly as for ``write``.
        The caller checks the blocks (it knows both pools' shapes) and turns its own errors
        into ``TransferError``; a cancelled ``copy`` must let a write already under way land
        before it re-raises, as ``write`` does."""
        if nbytes < 0 or num_tokens < 0:
            raise ValueError(f"request {request_id!r}: nbytes and num_tokens must be >= 0")
        return await self._charge("write", request_id, nbytes, num_tokens, copy)

    async def _charge(self, op: str, request_id: str, nbytes: int, num_tokens: int,
                      copy: Optional[Callable[[], Awaitable[float]]],
                      emulated_nbytes: Optional[int] = None) -> TransferRecord:
        """Put the transfer on the link model, run the real ``copy`` (None: no bytes move), wait
        out the rest. ``emulated_nbytes``: what the link is charged (default: ``emulation``'s
        reading of the real bytes)."""
        if emulated_nbytes is None:
            emulated_nbytes = self.emulation.nbytes(num_tokens, nbytes)
        transfer_id = next(self._ids)
        start = self.clock.now()
        self.model.start(transfer_id, emulated_nbytes)
        landed = False
        try:
            if self._faults:
                self._faults -= 1
                raise TransferError(f"request {request_id!r}: injected link fault")
            real_copy_s = await copy() if copy is not None else 0.0
            if self._stalls:
                await self._sleep(self._stalls.pop(0))
            model_end = await self._wait_out(transfer_id)
            landed = True
        finally:  # success, copy error or cancellation: the link never keeps a ghost
            self.model.remove(transfer_id, completed=landed)
            if not landed:
                self._totals["num_failed"] += 1
        end = self.clock.now()
        record = TransferRecord(request_id, nbytes, emulated_nbytes, real_copy_s, end - start,
                                start, end, max(model_end - start, 0.0), op)
        self._account(record)
        return record

    async def _copy(self, request_id: str, src_pool: torch.Tensor, src_block_ids: Sequence[int],
                    dst_pool: torch.Tensor, dst_block_ids: Sequence[int],
                    executor: Optional[Executor]) -> float:
        """Run the real copy (inline or on ``executor``); returns its seconds on the clock."""
        num_copies, host_buffer = self.profile.num_copies, None
        if num_copies > 1 and (src_pool.is_cuda or dst_pool.is_cuda):
            host_buffer = self._bounce.take(len(src_block_ids) * block_nbytes(src_pool))

        def timed_copy() -> float:
            t0 = self.clock.now()
            copy_blocks(src_pool, src_block_ids, dst_pool, dst_block_ids, num_copies, host_buffer)
            return self.clock.now() - t0

        try:
            if executor is None:
                return timed_copy()
            job = executor.submit(timed_copy)
            future = asyncio.wrap_future(job)
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                # A copy already running still writes dst blocks: let it land before the
                # caller hears of the cancel (and frees those blocks).
                job.cancel()
                await asyncio.wait([future])
                raise
        except (RuntimeError, IndexError, ValueError) as e:
            raise TransferError(f"request {request_id!r}: copy failed: {e}") from e
        finally:
            if host_buffer is not None:
                self._bounce.give(host_buffer)

    async def _wait_out(self, transfer_id: int) -> float:
        """Sleep until the link model lands the transfer; re-ask after each wake, because
        transfers that started meanwhile push the landing time later."""
        while True:
            model_end = self.model.finish_time(transfer_id)
            delay = model_end - self.clock.now()
            if delay <= 0:
                return model_end
            # Timer for the bulk, then yield-spin through the last spin_s (see the class doc).
            await self._sleep(delay - self.spin_s if delay > self.spin_s else 0.0)

    def _account(self, record: TransferRecord) -> None:
        t = self._totals
        t["bytes"] += record.nbytes
        t["emulated_bytes"] += record.emulated_nbytes
        t["real_copy_s"] += record.real_copy_s
        t["emulated_s"] += record.emulated_s
        t["num_copy_bound"] += record.copy_bound
