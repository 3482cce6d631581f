"""Instance lifecycle for the control plane: flips, adding and removing instances, failures.

``Cluster`` mixes this in; everything runs on the event-loop thread (the thread rule).

Flip (TetriInfer §3.5, Figure 10)::

    active ──flip()──► draining ──holds nothing, no KV moving──► flipping ──► active (other role)
              │  prefill: the global scheduler stops sending it requests
              │  decode:  every dispatcher stops choosing it; it finishes what it runs

Only the role variable and the scheduler object change: the worker thread, the model weights and
the KV pool stay. ``drain_s`` and ``flip_s`` (the switch alone, the paper's 5-7 ms) are recorded
separately. ``remove_instance`` drains the same way, then stops the worker and frees the pool.

Failure: a step that raises, or a worker that dies, calls ``on_instance_failed``. The instance is
marked ``failed`` and leaves every routing view; each request it held is re-run from its prompt on a
healthy instance (``on_failure="rerun"``, the default) keeping the tokens already streamed, so the
client sees only latency; with no healthy instance left (or ``on_failure="error"``) it ends with a
clear error. Decode-side blocks reserved for KV that never arrives are reclaimed after ``lease_s``.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING, Optional

from scheduling.flip import InstanceView, make_flip_policy, other_role
from scheduling.request import Status

if TYPE_CHECKING:
    from aserve.cluster import Handle
    from aserve.instance import Instance

ROLES = ("prefill", "decode", "coupled")
DRAIN_POLL_S = 0.002


class InstanceError(ValueError):
    """A lifecycle request that cannot be carried out (unknown id, last of its role, ...)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status  # the HTTP status the admin API answers with


class LifecycleMixin:
    def _init_lifecycle(self) -> None:
        self.events: collections.deque = collections.deque(maxlen=500)
        self.flip_log: list[dict] = []  # every flip: instance, from, to, drain_s, flip_s, reason
        self.counts.update(flips=0, reruns=0, transfer_retries=0, reclaimed=0, instance_failures=0)
        self._watcher: Optional[asyncio.Task] = None
        self._flip_policy = make_flip_policy(self.cfg.flip, **self._flip_options())
        self._next_instance = 0
        self._changing: set[str] = set()  # instances being drained / flipped / removed
        self._transfer_faults = 0  # drills: transfers still to fail (inject_transfer_faults)

    def _flip_options(self) -> dict:
        if self.cfg.flip == "ratio":
            return {"window_s": self.cfg.flip_window_s}
        if self.cfg.flip == "idle":
            return {"idle_s": self.cfg.flip_idle_s}
        return {}

    def log_event(self, kind: str, instance: Optional[str], message: str) -> None:
        """The event log the monitor shows: flips, failures, re-runs, retries, rejections."""
        self.events.append({"time": time.time(), "kind": kind, "instance": instance, "message": message})

    # ---- the transition watcher ----------------------------------------------------------------
    def _start_watcher(self) -> None:
        if self.cfg.flip != "off" and self.cfg.mode == "disagg":
            self._watcher = asyncio.create_task(self._watch(), name="flip-watcher")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.flip_check_s)
            if self._changing:
                continue
            decision = self._flip_policy.decide(self.clock.now(), self.instance_views())
            if decision is not None:
                self._spawn(self._flip_quietly(decision.instance_id, decision.to_role, decision.reason))

    async def _flip_quietly(self, iid: str, role: str, reason: str) -> None:
        try:
            await self.flip(iid, role, reason=reason)
        except InstanceError as e:  # the cluster changed since the decision: log, do not crash
            self.log_event("flip_refused", iid, str(e))

    def instance_views(self) -> list[InstanceView]:
        views = []
        for inst in self.instances.values():
            dec = inst.decode
            views.append(InstanceView(
                inst.id, inst.role, inst.state, inst.busy_by_role["prefill"], inst.busy_by_role["decode"],
                inst.num_prefill_tokens, inst.num_decode_tokens,
                inst.prefill.num_queued_tokens if inst.prefill is not None else 0,
                inst.holds() if dec is not None else 0,
                len(dec.waiting_ids) + inst.num_transfers_in if dec is not None else 0))
        return views

    # ---- flips, adds, removals -----------------------------------------------------------------
    def _get(self, iid: str) -> "Instance":
        inst = self.instances.get(iid)
        if inst is None:
            raise InstanceError(f"no instance {iid!r}; instances: {', '.join(self.instances) or 'none'}", 404)
        return inst

    def _check_leaving(self, inst: "Instance", what: str) -> None:
        """Refuse to take away the last active instance a mode needs."""
        if inst.state != "active" or inst.id in self._changing:
            raise InstanceError(f"instance {inst.id} is {inst.state}{' and changing' if inst.id in self._changing else ''}")
        peers = [i for i in self.instances.values()
                 if i.role == inst.role and i.state == "active" and i.id not in self._changing]
        if len(peers) <= 1:
            raise InstanceError(f"cannot {what} {inst.id}: it is the last active {inst.role} instance")

    async def _drain(self, inst: "Instance") -> float:
        """Stop routing to ``inst`` and wait until it holds nothing and moves no KV; seconds."""
        t0 = time.perf_counter()
        inst.state = "draining"
        self._broadcast()  # dispatchers drop it now, not at the next monitor tick
        if inst.prefill is not None:  # queued prompts not started yet go to the other prefill instances
            for req in inst.prefill.take_unstarted():
                handle = self.requests.get(req.request_id)
                if handle is not None and not self._place(handle):
                    self._finish(handle, "error", error="no instance can take the request")
        while inst.holds() or inst.num_transfers_in or inst.num_transfers_out:
            if inst.state == "failed":
                raise InstanceError(f"instance {inst.id} failed while draining: {inst.failure}")
            await asyncio.sleep(DRAIN_POLL_S)
        return time.perf_counter() - t0

    async def flip(self, iid: str, to_role: Optional[str] = None, reason: str = "asked") -> dict:
        """Drain instance ``iid`` and switch it to ``to_role`` (default: the other role)."""
        inst = self._get(iid)
        if self.cfg.mode != "disagg":
            raise InstanceError("flips need disaggregated mode")
        to_role = to_role or other_role(inst.role)
        if to_role == inst.role or to_role not in ("prefill", "decode"):
            raise InstanceError(f"cannot flip {iid} from {inst.role} to {to_role}", 400)
        self._check_leaving(inst, "flip")
        self._changing.add(iid)
        try:
            drain_s = await self._drain(inst)
            t0 = time.perf_counter()
            inst.state = "flipping"
            from_role = inst.role
            await inst.switch_role(to_role)
            inst.state = "active"
            flip_s = time.perf_counter() - t0
        except BaseException:
            if inst.state != "failed":
                inst.state = "active"
            raise
        finally:
            self._changing.discard(iid)
            self._broadcast()
        record = {"time": time.time(), "instance": iid, "from": from_role, "to": to_role,
                  "drain_s": drain_s, "flip_s": flip_s, "reason": reason}
        self.flip_log.append(record)
        self.counts["flips"] += 1
        self._flip_policy.note_flip(self.clock.now())
        self.log_event("flip", iid, f"{from_role} -> {to_role} (drain {drain_s * 1e3:.0f} ms, "
                                 f"flip {flip_s * 1e3:.1f} ms): {reason}")
        return record

    def add_instance(self, role: str) -> "Instance":
        """A new instance with its own KV pool, sharing the loaded weights; routed to at once."""
        if role not in ROLES or (role == "coupled") != (self.cfg.mode == "coupled"):
            allowed = "coupled" if self.cfg.mode == "coupled" else "prefill or decode"
            raise InstanceError(f"bad role {role!r} for {self.cfg.mode} mode: {allowed}", 400)
        live = sum(i.state != "failed" for i in self.instances.values())
        iid = f"{role[0]}{self._next_instance}"
        self._next_instance += 1
        inst = self._add_instance(iid, role, self._threads_per_instance(live + 1))
        self._broadcast()
        self.log_event("instance_added", iid, f"added a {role} instance")
        return inst

    async def remove_instance(self, iid: str) -> dict:
        """Drain ``iid`` (no request is lost), stop its worker and free its pool."""
        inst = self._get(iid)
        if inst.state != "failed":
            self._check_leaving(inst, "remove")
            self._changing.add(iid)
            try:
                drain_s = await self._drain(inst)
            except BaseException:
                if inst.state != "failed":
                    inst.state = "active"
                self._changing.discard(iid)
                raise
        else:
            drain_s = 0.0
        inst.state = "removed"
        self._changing.discard(iid)
        await inst.stop()
        self.instances.pop(iid, None)
        self.links = {k: v for k, v in self.links.items() if iid not in k}
        self._broadcast()
        self.log_event("instance_removed", iid, f"removed after a {drain_s * 1e3:.0f} ms drain")
        return {"instance": iid, "drain_s": drain_s}

    def instances_view(self) -> list[dict]:
        """The admin view: role, state and load of every instance."""
        return [{"id": i.id, "role": i.role, "state": i.state, "device": i.device,
                 "requests": i.holds(), "queued_tokens": i.queued_tokens(),
                 "free_blocks": i.blocks.num_free, "total_blocks": i.blocks.num_blocks,
                 "busy_s": i.busy_s, "flips": i.num_flips, "failure": i.failure}
                for i in self.instances.values()]

    # ---- failures ------------------------------------------------------------------------------
    def inject_fault(self, iid: str) -> None:
        """Fault drill: the instance's next step raises, as a device error would."""
        self._get(iid).inject_fault()

    def inject_transfer_faults(self, n: int = 1) -> None:
        """Fault drill: the next ``n`` KV transfers, on whichever links they use, fail mid-way."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._transfer_faults = n

    def kill_instance(self, iid: str, why: str = "killed") -> None:
        """Fault drill: the worker dies now, mid-step or idle."""
        inst = self._get(iid)
        if inst.task is not None:
            inst.task.cancel()
        self.on_instance_failed(inst, why)

    def on_instance_failed(self, inst: "Instance", why: str) -> None:
        """Mark ``inst`` failed, route around it, and re-run (or fail) every request it held."""
        if inst.state in ("failed", "removed"):
            return
        inst.state, inst.failure = "failed", why
        self.counts["instance_failures"] += 1
        self.log_event("instance_failed", inst.id, why)
        self._broadcast()
        for handle in list(self.requests.values()):
            if handle.phase == "done":
                continue
            held_here = handle.instance_id == inst.id and handle.phase in ("prefill", "decode")
            sent_from_here = handle.phase == "transfer" and handle.prefill_instance == inst.id
            if held_here or sent_from_here:
                self._rerun(handle, f"instance {inst.id} failed: {why}")
        # transfers towards it notice on their own (the receiver is no longer active) and retry

    def _rerun(self, handle: "Handle", why: str) -> None:
        """Start the request again from its prompt on a healthy instance (its KV is gone). The
        tokens already streamed stay: they are recomputed with the prompt, and generation goes on
        after them, so the client sees a pause, not a restart."""
        req = handle.request
        handle.epoch += 1
        if self.cfg.on_failure == "error":
            self._finish(handle, "error", error=why)
            return
        for inst in self.instances.values():  # a handoff's reservation for it, wherever it is
            if inst.decode is not None and req.request_id in inst.decode.incoming_ids:
                inst.decode.abort(req.request_id)
        req.block_ids, req.num_computed_tokens, req.status = [], 0, Status.WAITING
        handle.prefill_instance = handle.decode_instance = None
        if self._place(handle):
            self.counts["reruns"] += 1
            self.log_event("rerun", handle.instance_id, f"{req.request_id} re-run after: {why}")
        else:
            self._finish(handle, "error", error=f"{why}; no healthy instance is left to re-run it")

    def _reclaim_leases(self) -> None:
        """Free decode-side reservations whose KV never arrived within ``lease_s``."""
        moving = {rid for rid, h in self.requests.items() if h.phase == "transfer"}
        for inst in self.instances.values():
            if inst.decode is None or inst.state == "failed":
                continue
            for rid in inst.decode.reclaim_incoming(self.cfg.lease_s, keep=moving):
                self.counts["reclaimed"] += 1
                self.log_event("lease_expired", inst.id, f"freed the blocks reserved for {rid}")
