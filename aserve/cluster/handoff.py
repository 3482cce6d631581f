"""The KV hand-over: a prefilled request's KV moves to a decode instance (TetriInfer §3.3.3).

    prefill instance ── dispatcher picks ──► decode instance reserves blocks (or: not now, retry)
          │                                        │
          └─ src.device.send_kv(..., link) ────────┘  real copy on the sender's copy thread,
                                                      emulated link time from netemu's LinkModel
    landed: the sender frees its blocks, the receiver queues the request (phase decode)

A transfer that fails or times out frees the blocks reserved on the receiver and is retried on
another decode instance (``transfer_retries`` times, then the request is re-run from its prompt).
While a copy is in flight its destination blocks are being written: a re-run asked for meanwhile
(the sender failed) waits until the copy has landed, so no reused block is ever written late.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Callable, Optional

from aserve.cluster.requests import EventLog, RequestHandle
from aserve.config import ClusterConfig
from aserve.engine.instance import Instance
from netemu import KVEmulation, KVLink, parse_link
from netemu.transfer import TransferError
from scheduling.clock import Clock
from scheduling.dispatch import NoDecodeInstance
from scheduling.request import Request


class Handoff:
    """Owns the links between instances and the transfers on them."""

    def __init__(self, cfg: ClusterConfig, clock: Clock, log: EventLog, instances: dict[str, Instance],
                 finish: Callable[..., None], rerun: Callable[[RequestHandle, str], None]):
        self.cfg, self.clock, self.log, self.instances = cfg, clock, log, instances
        self._finish, self._rerun = finish, rerun
        self.links: dict[tuple[str, str], KVLink] = {}
        self.link_profile = parse_link(cfg.link)
        self.emulation = KVEmulation.from_args(cfg.emulate_model, cfg.emulate_kv_bytes_per_token)
        self.counts = {"transfer_retries": 0}
        self._faults = 0  # drills: transfers still to fail (inject_faults)
        self._sending: collections.Counter = collections.Counter()  # instance id -> hand-overs from it
        self._receiving: collections.Counter = collections.Counter()  # instance id -> copies into it
        self._copying: set[str] = set()  # request ids whose copy is in flight
        self._rerun_after_copy: dict[str, str] = {}  # request id -> why: re-run once its copy landed

    # ---- views and drills --------------------------------------------------------------------
    def moving(self, instance_id: str) -> int:
        """Hand-overs from or copies into the instance (a drain waits for none)."""
        return self._sending[instance_id] + self._receiving[instance_id]

    def receiving(self, instance_id: str) -> int:
        return self._receiving[instance_id]

    def inject_faults(self, n: int = 1) -> None:
        """Fault drill: the next ``n`` KV transfers, on whichever links they use, fail mid-way."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._faults = n

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

    # ---- the hand-over -----------------------------------------------------------------------
    async def run(self, src: Instance, handle: RequestHandle) -> None:
        """Move the request's KV from ``src`` to a decode instance the dispatcher picks. If ``src``
        fails meanwhile the request has already been re-run (its epoch moved on) and this task only
        cleans up after itself."""
        req, epoch = handle.request, handle.epoch
        rid = req.request_id
        tried: set[str] = set()
        failures = 0
        self._sending[src.id] += 1
        try:
            while True:
                if handle.epoch != epoch:
                    return
                if handle.aborted:
                    src.abort(rid)
                    self._finish(handle, "abort")
                    return
                dst = self._pick_decode(src, req, tried)
                dst_blocks = dst.reserve_kv(req) if dst is not None else None
                if dst_blocks is None:
                    if tried and dst is None:
                        tried.clear()  # every decode instance failed us once: try them all again
                    await asyncio.sleep(self.cfg.monitor_interval_s / 10)  # every decode instance is full
                    continue
                ok = await self._transfer(src, dst, handle, dst_blocks)
                why = self._rerun_after_copy.pop(rid, None)
                if why is not None:  # src failed during the copy: the copy has landed, re-run now
                    dst.abort(rid)
                    self._rerun(handle, why)
                    return
                if handle.epoch != epoch:
                    return
                if ok and dst.state in ("active", "draining"):  # draining: it finishes what it holds
                    break
                dst.abort(rid)  # frees what was reserved there (a dead instance: harmless)
                tried.add(dst.id)
                failures += 1
                self.log.log("transfer_retry", dst.id, f"{rid}: KV transfer to {dst.id} failed, retry {failures}")
                self.counts["transfer_retries"] += 1
                if failures > self.cfg.transfer_retries:
                    src.abort(rid)
                    self._rerun(handle, f"KV transfer failed {failures} times")
                    return
        finally:
            self._sending[src.id] -= 1
        src.release_kv(rid)
        if handle.aborted:
            dst.abort(rid)
            self._finish(handle, "abort")
            return
        dst.accept_kv(req)
        handle.instance_id, handle.decode_instance, handle.phase = dst.id, dst.id, "decode"

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

    async def _transfer(self, src: Instance, dst: Instance, handle: RequestHandle, dst_blocks: list[int]) -> bool:
        """One KV copy over the link, bounded by ``transfer_timeout_s``; False if it failed."""
        req = handle.request
        req.times["transfer_start"] = self.clock.now()
        self._receiving[dst.id] += 1
        self._copying.add(req.request_id)
        link = self._link(src, dst)
        if self._faults:
            self._faults -= 1
            link.fail_next(1)
        try:
            # a timeout cancels the copy; the link lets a copy already running land first
            record = await asyncio.wait_for(
                src.device.send_kv(req.request_id, req.block_ids, dst.device, dst_blocks, link,
                                   num_tokens=req.num_computed_tokens),
                self.cfg.transfer_timeout_s)
        except (TransferError, asyncio.TimeoutError) as e:
            req.times["transfer_error"] = f"{type(e).__name__}: {e}"
            return False
        finally:
            self._receiving[dst.id] -= 1
            self._copying.discard(req.request_id)
        req.times["transfer_end"] = self.clock.now()
        req.times["transfer_real_s"] = record.real_copy_s
        return True

    def _link(self, src: Instance, dst: Instance) -> KVLink:
        key = (src.id, dst.id)
        if key not in self.links:
            self.links[key] = KVLink(self.link_profile, self.clock, emulation=self.emulation)
        return self.links[key]
