"""The KV hand-over: a prefilled request's KV moves to a decode instance (TetriInfer §3.3.3).

    prefill instance ── dispatcher picks ──► decode instance reserves blocks (or: not now, retry)
          │                                        │
          └─ src.device.send_kv(..., link) ────────┘  real copy on the sender's copy thread,
                                                      emulated link time from netemu's LinkModel
    landed: the sender frees its blocks, the receiver queues the request (phase decode)

Failure handling, every step counted (``counts``):

    attempt fails (the copy raised, ran past transfer_timeout_s, or the receiver went away)
        └─► transfer_failures (+ transfer_timeouts) ─► frees what the receiver reserved ─►
            retried on another decode instance (transfer_retries), then given up
    no decode instance has room (or none is left) for lease_s ─► prefill_leases_expired, given up
                (meanwhile it waits in the hand-over's waiting room, retried only when some
                decode instance has the blocks it needs: see ``_tend_room``)
    given up ─► on_transfer_failure: recompute (transfer_recomputes: re-run from the prompt,
                the tokens streamed so far kept) | fail (transfer_failed_requests: an error the
                client can read); the sender's blocks are freed either way

So prefilled KV is never held forever. While a copy is in flight its destination blocks are being
written: a re-run asked for meanwhile (the sender failed) waits until the copy has landed, so no
reused block is ever written late.

A rebalance's move of a running decode (adaptive mode, ``migrate``) goes over the same links with
one try: no room on the receiver or a failed copy leaves the decode where it was
(``migrations_kept``); a move that landed counts in ``migrations``.
"""
from __future__ import annotations

import asyncio
import collections
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

from aserve.cluster.requests import EventLog, RequestHandle
from aserve.config import ClusterConfig
from aserve.engine.instance import Instance
from netemu import KVEmulation, KVLink, parse_link
from netemu.transfer import TransferError
from scheduling.block_manager import blocks_needed
from scheduling.clock import Clock
from scheduling.dispatch import NoDecodeInstance
from scheduling.request import Request

COUNTERS = ("transfer_failures", "transfer_timeouts", "transfer_retries", "transfer_recomputes",
            "transfer_failed_requests", "prefill_leases_expired", "migrations", "migrations_kept")


@dataclass(eq=False)
class _Waiter:
    """A prefilled request no decode instance has room for, in the waiting room."""

    handle: RequestHandle
    epoch: int
    since: float  # when it began waiting (its lease)
    woken: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Handoff:
    """Owns the links between instances and the transfers on them. ``rerun`` re-runs a request
    whose sender failed (the instance-failure policy); ``recompute`` re-runs one from its prompt."""

    def __init__(self, cfg: ClusterConfig, clock: Clock, log: EventLog, instances: dict[str, Instance],
                 finish: Callable[..., None], rerun: Callable[[RequestHandle, str], None],
                 recompute: Callable[[RequestHandle, str], None],
                 spawn: Callable[..., asyncio.Task] = asyncio.create_task):
        self.cfg, self.clock, self.log, self.instances = cfg, clock, log, instances
        self._spawn = spawn
        self._finish, self._rerun, self._recompute = finish, rerun, recompute
        self.links: dict[tuple[str, str], KVLink] = {}
        self.link_profile = parse_link(cfg.link)
        self.emulation = KVEmulation.from_args(cfg.emulate_model, cfg.emulate_kv_bytes_per_token)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._faults: collections.deque = collections.deque()  # drills: ("fail" | seconds to stall) per transfer
        self._sending: collections.Counter = collections.Counter()  # instance id -> hand-overs from it
        self._receiving: collections.Counter = collections.Counter()  # instance id -> copies into it
        self._copying: set[str] = set()  # request ids whose copy is in flight
        self._rerun_after_copy: dict[str, str] = {}  # request id -> why: re-run once its copy landed
        self._room: list[_Waiter] = []  # hand-overs waiting for a decode instance with room, in order
        self._tender: Optional[asyncio.Task] = None  # wakes them (``_tend_room``) while there are any
        # what a tick may skip on (``_tend_room``): the fewest KV tokens and the oldest lease start
        # among the waiters, and whether one of them may have changed since the last walk
        self._room_min_tokens: Optional[int] = None
        self._room_min_since = float("inf")
        self._room_changed = False

    # ---- views and drills --------------------------------------------------------------------
    def moving(self, instance_id: str) -> int:
        """Hand-overs from or copies into the instance (a drain waits for none)."""
        return self._sending[instance_id] + self._receiving[instance_id]

    @property
    def num_waiting(self) -> int:
        """Prefilled requests waiting for a decode instance with room."""
        return sum(not w.woken.done() for w in self._room)

    def receiving(self, instance_id: str) -> int:
        return self._receiving[instance_id]

    def inject_faults(self, n: int = 1, stall_s: Optional[float] = None) -> None:
        """Fault drill: the next ``n`` KV transfers, on whichever links they use, fail mid-way
        (or, with ``stall_s``, hang that long after their copy, as a stuck link would)."""
        if n < 0 or (stall_s is not None and stall_s < 0):
            raise ValueError(f"n and stall_s must be >= 0, got {n}, {stall_s}")
        self._faults.extend(["fail" if stall_s is None else stall_s] * n)

    def forget_instance(self, instance_id: str) -> None:
        """A removed instance's links go with it."""
        self.links = {k: v for k, v in self.links.items() if instance_id not in k}

    def defer_rerun(self, request_id: str, why: str) -> bool:
        """If the request's KV is being copied, re-run it once the copy has landed (its blocks on
        the receiver are still being written) and return True; else False: re-run it now."""
        if request_id not in self._copying:
            return False
        self._rerun_after_copy[request_id] = why
        return True

    def request_changed(self) -> None:
        """A request was aborted or re-run (its handle's ``aborted`` or ``epoch``): if it waits in
        the room, the next tick must see it (``_tend_room``)."""
        self._room_changed = True

    # ---- the hand-over -----------------------------------------------------------------------
    async def run(self, src: Instance, handle: RequestHandle) -> None:
        """Move the request's KV from ``src`` to a decode instance the dispatcher picks. If ``src``
        fails meanwhile the request has already been re-run (its epoch moved on) and this task only
        cleans up after itself."""
        req = handle.request
        self._sending[src.id] += 1
        try:
            dst = await self._move(src, handle)
        finally:
            self._sending[src.id] -= 1
        if dst is None:  # ended, re-run or given up: nothing of it is left on either side
            return
        src.release_kv(req.request_id)
        if handle.aborted:
            dst.abort(req.request_id)
            self._finish(handle, "abort")
            return
        dst.accept_kv(req)
        handle.instance_id, handle.decode_instance, handle.phase = dst.id, dst.id, "decode"

    async def migrate(self, src: Instance, handle: RequestHandle, dst: Instance) -> bool:
        """Adaptive rebalance: move a running decode's KV from ``src`` to ``dst`` (of either
        role). One try: if ``dst`` has no room or the copy fails, the decode goes on where it
        was (``migrations_kept``); nothing is lost and nothing retried, the next rebalance may
        try again. Whether it moved."""
        req, epoch = handle.request, handle.epoch
        rid = req.request_id
        self._sending[src.id] += 1
        try:
            blocks = dst.reserve_kv(req) if dst.state == "active" else None
            error = "no room" if blocks is None else await self._transfer(src, dst, handle, blocks)
            why = self._rerun_after_copy.pop(rid, None)
            if why is not None or handle.epoch != epoch:  # src failed meanwhile: re-run (if not already)
                if blocks is not None:
                    dst.abort(rid)
                if why is not None:
                    self._rerun(handle, why)
                return False
            if error is None and dst.state not in ("active", "draining"):
                error = f"the receiver {dst.id} is {dst.state}"
            if error is not None:
                if blocks is not None:
                    dst.abort(rid)
                    self.counts["transfer_failures"] += 1
                self.counts["migrations_kept"] += 1
                if handle.aborted:
                    src.abort(rid)
                    self._finish(handle, "abort")
                else:
                    src.keep_kv(rid)
                    handle.phase = "decode"
                return False
        finally:
            self._sending[src.id] -= 1
        src.release_kv(rid)
        self.counts["migrations"] += 1
        if handle.aborted:
            dst.abort(rid)
            self._finish(handle, "abort")
            return False
        dst.accept_kv(req)
        handle.instance_id, handle.decode_instance, handle.phase = dst.id, dst.id, "decode"
        return True

    async def _move(self, src: Instance, handle: RequestHandle) -> Optional[Instance]:
        """Reserve, copy, retry; the decode instance the KV landed on, or None when the request
        ended another way (aborted, re-run by a failure, or given up after retries or the lease)."""
        req, epoch = handle.request, handle.epoch
        rid = req.request_id
        tried: set[str] = set()
        failures, waiting_since = 0, None
        while True:
            if handle.epoch != epoch:
                return None
            if handle.aborted:
                src.abort(rid)
                self._finish(handle, "abort")
                return None
            dst = self._pick_decode(src, req, tried)
            dst_blocks = dst.reserve_kv(req) if dst is not None else None
            if dst_blocks is None:  # every decode instance is full (or none is left)
                waiting_since = self.clock.now() if waiting_since is None else waiting_since
                if not await self._wait_for_room(src, handle, waiting_since):
                    return None
                if tried and dst is None:
                    tried.clear()  # every decode instance failed us once: try them all again
                continue
            waiting_since = None
            error = await self._transfer(src, dst, handle, dst_blocks)
            why = self._rerun_after_copy.pop(rid, None)
            if why is not None:  # src failed during the copy: the copy has landed, re-run now
                dst.abort(rid)
                self._rerun(handle, why)
                return None
            if handle.epoch != epoch:
                return None
            if error is None and dst.state not in ("active", "draining"):  # draining: it finishes what it holds
                error = f"the receiver {dst.id} is {dst.state}"
            if error is None:
                return dst
            dst.abort(rid)  # frees what was reserved there (a dead instance: harmless)
            tried.add(dst.id)
            failures += 1
            self.counts["transfer_failures"] += 1
            if failures > self.cfg.transfer_retries:
                self._give_up(src, handle, f"its KV transfer failed {failures} times (last: {error})")
                return None
            self.counts["transfer_retries"] += 1
            self.log.log("transfer_retry", dst.id, f"{rid}: KV transfer to {dst.id} failed ({error}), retry {failures}")

    async def _wait_for_room(self, src: Instance, handle: RequestHandle, since: float) -> bool:
        """Wait for a decode instance with room; False once the lease has run out (the KV is
        released and the request given up): prefilled KV is never held forever."""
        if self.clock.now() - since >= self.cfg.lease_s:
            self.counts["prefill_leases_expired"] += 1
            self._give_up(src, handle, f"no decode instance had room for it within the {self.cfg.lease_s:g} s lease")
            return False
        waiter = _Waiter(handle, handle.epoch, since)
        self._room.append(waiter)
        tokens = handle.request.num_computed_tokens
        self._room_min_tokens = tokens if self._room_min_tokens is None else min(self._room_min_tokens, tokens)
        self._room_min_since = min(self._room_min_since, since)
        if self._tender is None or self._tender.done():
            self._tender = self._spawn(self._tend_room())
        try:
            await waiter.woken
        finally:
            if waiter.woken.cancelled() or not waiter.woken.done():
                self._room_changed = True  # not woken by a tick: the next one drops it
            waiter.woken.cancel()  # a cancelled wait leaves the room at the next tick
        return True

    async def _tend_room(self) -> None:
        """Every tenth of a monitor interval, wake the waiting hand-overs that may go on: those
        some active decode instance has the blocks for now (in the order they entered the room,
        each counted against the roomiest such instance, so one freed block does not wake them
        all), and those whose request ended, was re-run, or whose lease ran out. The rest sleep
        on: in an overloaded cluster hundreds of prefilled requests wait, and retrying each one's
        dispatch every tick cost most of a simulated run's time without placing one more.

        A tick walks the room only when the walk could wake someone: the roomiest instance has
        the blocks of the waiter that needs fewest, the oldest lease ran out, or a waiter's request
        changed (``request_changed``) or its wait ended. Otherwise the walk would wake nobody and
        leave the room as it is: walking hundreds of waiters every tick was a sixth of an
        overloaded disaggregated replay's time (issue 57)."""
        while self._room:
            await asyncio.sleep(self.cfg.monitor_interval_s / 10)
            now, lease = self.clock.now(), self.cfg.lease_s
            rooms = [[inst.kv_room(), inst.blocks.block_size] for inst in self.instances.values()
                     if inst.role == "decode" and inst.state == "active"]
            most = max((room for room, _ in rooms), default=-1)  # no waiter needing more goes on
            size = max((size for _, size in rooms), default=1)  # the fewest blocks any room counts
            if (not self._room_changed and now - self._room_min_since < lease
                    and blocks_needed(self._room_min_tokens, size) > most):
                continue  # blocks_needed and the lease test are monotone: nobody would go on
            self._walk_room(now, lease, rooms, most, size)

    def _walk_room(self, now: float, lease: float, rooms: list[list[int]], most: int, size: int) -> None:
        waiting, min_tokens, min_since = [], None, float("inf")
        for w in self._room:
            if w.woken.done():  # its wait was cancelled
                continue
            h = w.handle
            if h.epoch != w.epoch or h.aborted or now - w.since >= lease:
                w.woken.set_result(None)
            elif (blocks_needed(h.request.num_computed_tokens, size) <= most
                  and _claim(rooms, h.request.num_computed_tokens)):
                w.woken.set_result(None)
                most = max(room for room, _ in rooms)
            else:
                waiting.append(w)
                tokens = h.request.num_computed_tokens
                min_tokens = tokens if min_tokens is None else min(min_tokens, tokens)
                min_since = min(min_since, w.since)
        self._room = waiting
        self._room_min_tokens, self._room_min_since, self._room_changed = min_tokens, min_since, False

    def _give_up(self, src: Instance, handle: RequestHandle, why: str) -> None:
        """The KV cannot be handed over: free it on the sender, then recompute or fail the request."""
        src.abort(handle.request.request_id)
        if self.cfg.on_transfer_failure == "fail":
            self.counts["transfer_failed_requests"] += 1
            self._finish(handle, "error", error=f"the KV cache could not be handed to a decode instance: {why}")
            return
        self.counts["transfer_recomputes"] += 1
        self._recompute(handle, f"KV hand-over given up: {why}")

    def _pick_decode(self, src: Instance, req: Request, tried: set) -> Optional[Instance]:
        try:
            dst = self.instances.get(src.choose_decode(req))
        except NoDecodeInstance:
            return None
        if dst is None or dst.state != "active" or dst.role != "decode":
            return None  # the view is up to one broadcast old
        if dst.id in tried:
            others = [i for i in self.instances.values()
                      if i.role == "decode" and i.state == "active" and i.id not in tried]
            return min(others, key=lambda i: (i.num_requests, i.id)) if others else None
        return dst

    async def _transfer(self, src: Instance, dst: Instance, handle: RequestHandle, dst_blocks: list[int]) -> Optional[str]:
        """One KV copy over the link, bounded by ``transfer_timeout_s``; why it failed, or None."""
        req = handle.request
        req.times["transfer_start"] = self.clock.now()
        self._receiving[dst.id] += 1
        self._copying.add(req.request_id)
        link = self._link(src, dst)
        if self._faults:
            fault = self._faults.popleft()
            link.fail_next(1) if fault == "fail" else link.stall_next(1, fault)
        try:
            # a timeout cancels the copy; the link lets a copy already running land first
            record = await asyncio.wait_for(
                src.device.send_kv(req.request_id, req.block_ids, dst.device, dst_blocks, link,
                                   num_tokens=req.num_computed_tokens),
                self.cfg.transfer_timeout_s)
        except asyncio.TimeoutError as e:
            drop_frames(e)
            self.counts["transfer_timeouts"] += 1
            req.times["transfer_error"] = f"timed out after {self.cfg.transfer_timeout_s:g} s"
            return req.times["transfer_error"]
        except TransferError as e:
            drop_frames(e)
            req.times["transfer_error"] = f"{type(e).__name__}: {e}"
            return req.times["transfer_error"]
        finally:
            self._receiving[dst.id] -= 1
            self._copying.discard(req.request_id)
        req.times["transfer_end"] = self.clock.now()
        req.times["transfer_real_s"] = record.real_copy_s
        return None

    def _link(self, src: Instance, dst: Instance) -> KVLink:
        key = (src.id, dst.id)
        if key not in self.links:
            self.links[key] = KVLink(self.link_profile, self.clock, emulation=self.emulation)
        return self.links[key]


def _claim(rooms: list[list[int]], num_tokens: int) -> bool:
    """Count ``num_tokens`` of KV against the room (``[free blocks, block size]``) left roomiest
    by it, if any has the blocks; whether one had."""
    best, best_left = None, -1
    for room in rooms:
        left = room[0] - blocks_needed(num_tokens, room[1])
        if left > best_left:
            best, best_left = room, left
    if best is None:
        return False
    best[0] = best_left
    return True


def drop_frames(exc: BaseException) -> None:
    """Clear the locals of every finished frame in ``exc``'s traceback and in those of the
    exceptions it chains to. Raised through ``asyncio.wait_for``, a transfer's exception is in a
    cycle (its traceback holds wait_for's frame, whose task holds the exception), and the frames
    of the copy in it hold both KV pools: only a full garbage collection frees them, which a
    large process runs rarely, so a removed instance's pool outlived it (the soak saw +0.1 GB
    a re-add in the test suite's process). The error's text is kept; its frames are not needed."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
