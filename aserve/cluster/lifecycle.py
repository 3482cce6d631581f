"""Instance lifecycle: flips, adding and removing instances, failures. Everything runs on the
event-loop thread (the thread rule).

Flip (TetriInfer §3.5, Figure 10)::

    active ──flip()──► draining ──holds nothing, no KV moving──► flipping ──► active (other role)
              │  prefill: the global scheduler stops sending it requests
              │  decode:  every dispatcher stops choosing it; it finishes what it runs

Adaptive mode (scheduling/hybrid.py) flips without a drain: every instance already runs the
same scheduler, so only the role and its hand-over switch change, at once. A decode instance
turning prefill moves its running decodes to the decode instances by KV migration (each leaves
after its next token, through the same hand-over as a prefilled prompt; ``flip_migrate``), so it
starts prefilling at full budget without waiting for them to end.

Otherwise only the role variable and the scheduler object change: the step loop's task, the model weights,
the device and its KV pool stay. ``drain_s`` and ``flip_s`` (the switch alone, the paper's 5-7
ms) are recorded separately. ``remove`` drains the same way, then stops the instance and frees
its device.

Failure: a step that raises, or a loop that dies, reaches ``on_failure``. The instance is marked
``failed`` and leaves every routing view; each request it held is re-run from its prompt on a
healthy instance (``on_failure="rerun"``, the default) keeping the tokens already streamed, so
the client sees only latency; with no healthy instance left (or ``on_failure="error"``) it ends
with a clear error. Decode-side blocks reserved for KV that never arrives are reclaimed after
``lease_s`` (the prefill side's bound on held KV is the hand-over's, aserve/cluster/handoff.py).

``Lifecycle`` is composed into the cluster and reaches it through ``ControlPlane`` only.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import time
from typing import Optional, Protocol

from aserve.cluster.handoff import Handoff
from aserve.cluster.requests import EventLog, RequestHandle
from aserve.config import ClusterConfig
from aserve.devices.device import Device
from aserve.engine.instance import Instance
from aserve.engine.policies import ROLES
from scheduling import registry
from scheduling.clock import Clock
from scheduling.flip import InstanceView, other_role
from scheduling.request import Status

DRAIN_POLL_S = 0.002


@functools.cache
def _libc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``), as a removed
    instance's pool and step buffers are freed. Each instance steps on a thread of its own, and
    glibc gives such threads malloc arenas of their own, which it keeps mapped for later threads:
    without a trim a server that removes and adds instances grows its RSS with each new thread's
    arena. Returns False where the C library has no ``malloc_trim`` (musl, macOS)."""
    trim = _libc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class InstanceError(ValueError):
    """A lifecycle request that cannot be carried out (unknown id, last of its role, ...)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status  # the HTTP status the admin API answers with


class ControlPlane(Protocol):
    """What the lifecycle needs of the cluster that owns it."""

    instances: dict[str, Instance]
    requests: dict[str, RequestHandle]
    handoff: Handoff

    def place(self, handle: RequestHandle) -> bool: ...

    def finish(self, handle: RequestHandle, reason: str, error: Optional[str] = None) -> None: ...

    def broadcast(self) -> None: ...

    def spawn(self, coro) -> asyncio.Task: ...

    def new_instance(self, instance_id: str, role: str, num_threads: int,
                     device: Optional[Device] = None) -> Instance: ...

    async def build_device(self, instance_id: str, role: str, num_threads: int) -> Device: ...

    def threads_per_instance(self, num_instances: int) -> int: ...

    def count_live(self) -> None: ...


class Lifecycle:
    def __init__(self, cfg: ClusterConfig, clock: Clock, log: EventLog, plane: ControlPlane):
        self.cfg, self.clock, self.log, self.plane = cfg, clock, log, plane
        self.flip_log: list[dict] = []  # every flip: instance, from, to, drain_s, flip_s, reason
        # every failure: instance, why, time, requests it held, recovered_s (None until the last of
        # them streams again or ends)
        self.failure_log: list[dict] = []
        self._recovering: dict[str, dict] = {}  # request id -> its failure's record
        self.counts = {"flips": 0, "reruns": 0, "decode_leases_expired": 0, "instance_failures": 0}
        self.flip_policy = registry.get("flip", cfg.flip)(**self._flip_options())
        self._watcher: Optional[asyncio.Task] = None
        self._next_instance = 0
        self._changing: set[str] = set()  # instances being drained / flipped / removed
        self._adding = 0  # adds whose device is still being built (they count against max_instances)

    def _flip_options(self) -> dict:
        if self.cfg.flip == "ratio":
            cfg = self.cfg
            return {"window_s": cfg.flip_window_s, "cooldown_s": cfg.flip_cooldown_s or None,
                    "band": cfg.flip_band, "dwell_s": cfg.flip_dwell_s or None}
        if self.cfg.flip == "idle":
            return {"idle_s": self.cfg.flip_idle_s}
        return {}

    # ---- start and stop ------------------------------------------------------------------------
    def start(self, roles: list[str]) -> None:
        """The first instances (sharing the cores evenly) and, if flips are on, the watcher."""
        threads = self.plane.threads_per_instance(len(roles))
        for role in roles:
            self._create(role, threads)
        if self.cfg.flip != "off" and self.cfg.split:
            self._watcher = asyncio.create_task(self._watch(), name="flip-watcher")

    def stop(self) -> None:
        if self._watcher:
            self._watcher.cancel()

    def _create(self, role: str, threads: int) -> Instance:
        return self.plane.new_instance(self._new_id(role), role, threads)

    def _new_id(self, role: str) -> str:
        iid = f"{role[0]}{self._next_instance}"
        self._next_instance += 1
        return iid

    # ---- the transition watcher ----------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.flip_check_s)
            if self._changing:
                continue
            decision = self.flip_policy.decide(self.clock.now(), self.views())
            if decision is not None:
                self.plane.spawn(self._flip_quietly(decision.instance_id, decision.to_role, decision.reason))

    async def _flip_quietly(self, iid: str, role: str, reason: str) -> None:
        try:
            await self.flip(iid, role, reason=reason)
        except InstanceError as e:  # the cluster changed since the decision: log, do not crash
            self.log.log("flip_refused", iid, str(e))

    def views(self) -> list[InstanceView]:
        """What the flip policy may know of each instance."""
        views = []
        for inst in self.plane.instances.values():
            decode = inst.role == "decode"
            views.append(InstanceView(
                inst.id, inst.role, inst.state, inst.busy_by_role["prefill"], inst.busy_by_role["decode"],
                inst.num_prefill_tokens, inst.num_decode_tokens,
                inst.num_queued_tokens if inst.role == "prefill" else 0,
                inst.num_requests if decode else 0,
                inst.num_waiting + self.plane.handoff.receiving(inst.id) if decode else 0))
        return views

    # ---- flips, adds, removals -----------------------------------------------------------------
    def get(self, iid: str) -> Instance:
        inst = self.plane.instances.get(iid)
        if inst is None:
            known = ", ".join(self.plane.instances) or "none"
            raise InstanceError(f"no instance {iid!r}; instances: {known}", 404)
        return inst

    def _check_leaving(self, inst: Instance, what: str) -> None:
        """Refuse to take away the last active instance a mode needs."""
        if inst.state != "active" or inst.id in self._changing:
            raise InstanceError(f"instance {inst.id} is {inst.state}{' and changing' if inst.id in self._changing else ''}")
        peers = [i for i in self.plane.instances.values()
                 if i.role == inst.role and i.state == "active" and i.id not in self._changing]
        if len(peers) <= 1:
            raise InstanceError(f"cannot {what} {inst.id}: it is the last active {inst.role} instance")

    async def _drain(self, inst: Instance) -> float:
        """Stop routing to ``inst`` and wait until it holds nothing and moves no KV; seconds (on the
        cluster's clock, so a simulated cluster's drains are simulated seconds too)."""
        t0 = self.clock.now()
        inst.state = "draining"
        self.plane.broadcast()  # dispatchers drop it now, not at the next monitor tick
        if inst.role == "prefill":  # queued prompts not started yet go to the other prefill instances
            for req in inst.take_unstarted():
                handle = self.plane.requests.get(req.request_id)
                if handle is not None and not self.plane.place(handle):
                    self.plane.finish(handle, "error", error="no instance can take the request")
        while inst.num_requests or self.plane.handoff.moving(inst.id):
            if inst.state == "failed":
                raise InstanceError(f"instance {inst.id} failed while draining: {inst.failure}")
            await asyncio.sleep(DRAIN_POLL_S)
        return self.clock.now() - t0

    async def flip(self, iid: str, to_role: Optional[str] = None, reason: str = "asked") -> dict:
        """Drain instance ``iid`` and switch it to ``to_role`` (default: the other role)."""
        inst = self.get(iid)
        if not self.cfg.split:
            raise InstanceError("flips need disaggregated or adaptive mode")
        to_role = to_role or other_role(inst.role)
        if to_role == inst.role or to_role not in ("prefill", "decode"):
            raise InstanceError(f"cannot flip {iid} from {inst.role} to {to_role}", 400)
        self._check_leaving(inst, "flip")
        if self.cfg.mode == "adaptive":
            return self._flip_live(inst, to_role, reason)
        self._changing.add(iid)
        try:
            drain_s = await self._drain(inst)
            t0 = time.perf_counter()  # the switch alone is host work: wall seconds, simulated or not
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
            self.plane.broadcast()
        return self._record_flip(iid, from_role, to_role, drain_s, flip_s, reason)

    def _flip_live(self, inst: Instance, to_role: str, reason: str) -> dict:
        """Adaptive: switch at once; a new prefill instance's decodes move out by KV migration."""
        t0, from_role = time.perf_counter(), inst.role
        inst.change_role_live(to_role)
        moved = inst.migrate_decodes() if to_role == "prefill" and self.cfg.flip_migrate else []
        self.plane.broadcast()  # its dispatcher (a new prefill instance) needs the decode loads now
        record = self._record_flip(inst.id, from_role, to_role, 0.0, time.perf_counter() - t0, reason)
        record["migrated"] = len(moved)
        return record

    def _record_flip(self, iid: str, from_role: str, to_role: str, drain_s: float, flip_s: float, reason: str) -> dict:
        record = {"time": time.time(), "at": self.clock.now(), "instance": iid, "from": from_role, "to": to_role,
                  "drain_s": drain_s, "flip_s": flip_s, "reason": reason}
        self.flip_log.append(record)
        self.counts["flips"] += 1
        self.flip_policy.note_flip(self.clock.now(), iid)
        self.log.log("flip", iid, f"{from_role} -> {to_role} (drain {drain_s * 1e3:.0f} ms, "
                                 f"flip {flip_s * 1e3:.1f} ms): {reason}")
        return record

    async def add(self, role: str, max_instances: Optional[int] = None, limit_flag: str = "max_instances") -> Instance:
        """A new instance with its own KV pool, sharing the loaded weights; routed to at once. The
        device is built off the event loop (``ControlPlane.build_device``): zeroing a pool of a
        gigabyte took up to 1.5 s here, a stall of every stream when it ran on the loop.
        ``max_instances``: refuse (409, naming ``limit_flag``) when the live instances and the adds
        still building their devices would pass it."""
        if role not in ROLES or (role == "coupled") != (self.cfg.mode == "coupled"):
            allowed = "coupled" if self.cfg.mode == "coupled" else "prefill or decode"
            raise InstanceError(f"bad role {role!r} for {self.cfg.mode} mode: {allowed}", 400)
        live = sum(i.state != "failed" for i in self.plane.instances.values())
        if max_instances is not None and live + self._adding >= max_instances:
            adding = f" and {self._adding} being added" if self._adding else ""
            raise InstanceError(f"the cluster has {live} live instances{adding}; at most {max_instances} "
                                f"({limit_flag}): remove one first, or raise {limit_flag}")
        threads, iid = self.plane.threads_per_instance(live + 1), self._new_id(role)
        self._adding += 1
        try:
            device = await self.plane.build_device(iid, role, threads)
        finally:
            self._adding -= 1
        inst = self.plane.new_instance(iid, role, threads, device)
        self.plane.broadcast()
        self.log.log("instance_added", inst.id, f"added a {role} instance")
        return inst

    async def remove(self, iid: str) -> dict:
        """Drain ``iid`` (no request is lost), stop it and free its device."""
        inst = self.get(iid)
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
        self.plane.count_live()
        await inst.stop()
        self.plane.instances.pop(iid, None)
        self.plane.handoff.forget_instance(iid)
        self.plane.broadcast()
        self.log.log("instance_removed", iid, f"removed after a {drain_s * 1e3:.0f} ms drain")
        del inst
        await asyncio.to_thread(release_freed_memory)
        return {"instance": iid, "drain_s": drain_s}

    def instances_view(self) -> list[dict]:
        """The admin view: role, state and load of every instance."""
        return [{"id": i.id, "role": i.role, "state": i.state, "device": i.device.kind,
                 "requests": i.num_requests, "queued_tokens": i.num_queued_tokens,
                 "free_blocks": i.blocks.num_free, "total_blocks": i.blocks.num_blocks,
                 "busy_s": i.busy_s, "flips": i.num_flips, "failure": i.failure}
                for i in self.plane.instances.values()]

    # ---- failures ------------------------------------------------------------------------------
    def inject_fault(self, iid: str) -> None:
        """Fault drill: the instance's next step raises, as a device error would."""
        self.get(iid).inject_fault()

    def kill(self, iid: str, why: str = "killed") -> None:
        """Fault drill: the instance's loop dies now, mid-step or idle."""
        inst = self.get(iid)
        if inst.task is not None:
            inst.task.cancel()
        self.on_failure(inst, why)

    def on_failure(self, inst: Instance, why: str) -> None:
        """Mark ``inst`` failed, route around it, and re-run (or fail) every request it held."""
        if inst.state in ("failed", "removed"):
            return
        inst.state, inst.failure = "failed", why
        self.counts["instance_failures"] += 1
        self.log.log("instance_failed", inst.id, why)
        self.plane.count_live()
        self.plane.broadcast()
        hit = [h for h in self.plane.requests.values() if h.phase != "done" and (
            (h.instance_id == inst.id and h.phase in ("prefill", "decode"))  # held here
            or (h.phase == "transfer" and h.prefill_instance == inst.id))]  # being sent from here
        record = {"instance": inst.id, "why": why, "time": time.time(), "at": self.clock.now(),
                  "requests": len(hit), "pending": len(hit), "recovered_s": None if hit else 0.0}
        self.failure_log.append(record)
        self._recovering.update((h.request.request_id, record) for h in hit)  # before a re-run can end one
        for handle in hit:
            self.rerun(handle, f"instance {inst.id} failed: {why}")
        # transfers towards it notice on their own (the receiver is no longer active) and retry

    def recovered(self, request_id: str) -> None:
        """A request streamed a token or ended: if a failure had hit it, it is over that one. The
        failure's ``recovered_s`` is the time until the last request it hit did so."""
        record = self._recovering.pop(request_id, None)
        if record is None:
            return
        record["pending"] -= 1
        if record["pending"] == 0:
            record["recovered_s"] = self.clock.now() - record["at"]
            self.log.log("recovered", record["instance"], f"the {record['requests']} requests it held stream "
                                                          f"again (or ended) {record['recovered_s'] * 1e3:.0f} ms on")

    def rerun(self, handle: RequestHandle, why: str) -> None:
        """A request whose instance failed: recompute it (``on_failure="rerun"``) or end it with
        the error (``"error"``)."""
        if self.plane.handoff.defer_rerun(handle.request.request_id, why):
            return  # its KV is landing on a decode instance: the hand-over re-runs it once it has
        if self.cfg.on_failure == "error":
            handle.epoch += 1
            self.plane.handoff.request_changed()
            self.plane.finish(handle, "error", error=why)
            return
        self.recompute(handle, why)

    def recompute(self, handle: RequestHandle, why: str) -> None:
        """Start the request again from its prompt on a healthy instance (its KV is gone). The
        tokens already streamed stay: they are recomputed with the prompt, and generation goes on
        after them, so the client sees a pause, not a restart."""
        req = handle.request
        handle.epoch += 1
        self.plane.handoff.request_changed()  # a hand-over waiting for room sees the new epoch
        for inst in self.plane.instances.values():  # a handoff's reservation for it, wherever it is
            if inst.reserves_kv_for(req.request_id):
                inst.abort(req.request_id)
        req.block_ids, req.num_computed_tokens, req.status = [], 0, Status.WAITING
        handle.prefill_instance = handle.decode_instance = None
        if self.plane.place(handle):
            self.counts["reruns"] += 1
            self.log.log("rerun", handle.instance_id, f"{req.request_id} re-run after: {why}")
        else:
            self.plane.finish(handle, "error", error=f"{why}; no healthy instance is left to re-run it")

    def reclaim_leases(self) -> None:
        """Free decode-side reservations whose KV never arrived within ``lease_s``."""
        moving = _InPhase(self.plane.requests, "transfer")  # asked only about stale reservations
        for inst in self.plane.instances.values():
            if inst.role != "decode" or inst.state == "failed":
                continue
            for rid in inst.reclaim_kv(self.cfg.lease_s, keep=moving):
                self.counts["decode_leases_expired"] += 1
                self.log.log("lease_expired", inst.id, f"freed the blocks reserved for {rid}")


class _InPhase:
    """``rid in view``: the request is in the table and in ``phase`` (a set of them all would
    cost a pass over every request each monitor tick; a long queue holds thousands)."""

    def __init__(self, requests: dict[str, RequestHandle], phase: str):
        self.requests, self.phase = requests, phase

    def __contains__(self, rid: object) -> bool:
        handle = self.requests.get(rid)
        return handle is not None and handle.phase == self.phase
