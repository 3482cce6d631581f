"""One instance: a role, its scheduler, its device, and the one step loop every role runs.

    while True:
        plan = scheduler.schedule()         # scheduling/: one contract for every role and policy
        if plan.empty: sleep until notified
        out = await device.execute(plan)    # the device seam (aserve/devices/device.py)
        events = scheduler.update(plan, out)
        stop checks (the instance's StopChecker) -> scheduler.finish(request, reason)
        host.on_step(self, StepReport)      # tokens, prefilled prompts, features: one call a step

The prefill, decode and coupled roles and the offline ``LLM`` all run this loop; they differ in
the scheduler only. The loop runs on the event loop; the forward runs on the device's own thread,
so instances compute in parallel and the loop stays responsive. Only the loop thread touches
schedulers, blocks and requests (the thread rule): the device gets the immutable plan.

The instance calls its host (the cluster, or the offline engine) through ``InstanceHost`` only,
and the host reaches the scheduler only through the façade methods below.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional, Protocol

from aserve.devices.device import Device
from aserve.engine.policies import Policies
from aserve.engine.stops import StopChecker
from scheduling.base import Adaptive, KVReceiver, KVSender, Scheduler
from scheduling.block_manager import BlockManager
from scheduling.clock import Clock
from scheduling.dispatch import DecodeLoad
from scheduling.request import Request
from scheduling.step import PromptLogprobs, StepOutput, StepPlan, TokenLogprobs



@dataclass(frozen=True)
class StepReport:
    """What one step produced, for the host."""

    tokens: tuple[tuple[Request, Optional[str]], ...]  # (request, finish reason or None), one new token each
    prefilled: tuple[Request, ...]  # prompt done here and not finished: KV ready for a hand-over
    features: Optional[Mapping[str, Any]]  # the length predictor's taps (request -> hidden state)
    num_tokens: int  # rows the step computed, padding included
    logprobs: Optional[Mapping[str, TokenLogprobs]] = None  # of this step's tokens, where asked
    prompt_logprobs: Optional[Mapping[str, PromptLogprobs]] = None  # scored prompt rows (echo)


class InstanceHost(Protocol):
    """The only callbacks an instance makes."""

    def on_step(self, instance: "Instance", report: StepReport) -> None:
        ...

    def on_failure(self, instance: "Instance", why: str) -> None:
        ...


class Instance:
    """``role`` is prefill, decode or coupled; ``state`` is active, draining, flipping, failed
    or removed (the control plane sets it)."""

    def __init__(self, instance_id: str, role: str, device: Device, policies: Policies, stops: StopChecker,
                 clock: Clock, host: InstanceHost):
        self.id, self.device, self.policies = instance_id, device, policies
        self.stops, self.clock, self.host = stops, clock, host
        self.state, self.failure = "active", None
        self.blocks = BlockManager(device.num_blocks, device.block_size, enable_caching=policies.prefix_caching)
        self.scheduler: Scheduler
        self.dispatcher = None  # prefill role: which decode instance takes a prefilled request
        self._make_role(role)
        self.wake: Optional[asyncio.Event] = None  # made by start(), on the loop that runs it
        self.task: Optional[asyncio.Task] = None
        # counters for metrics and the paper's resource-usage time
        self.busy_s = 0.0  # seconds with a step on the device (the emulated device's, if slower)
        self.busy_by_role = {"prefill": 0.0, "decode": 0.0, "coupled": 0.0}
        self.num_steps = self.num_prefill_tokens = self.num_decode_tokens = self.num_pad_tokens = 0
        self.num_preemptions = self.num_flips = 0
        self.step_log = None  # a StepLog (aserve/engine/step_log.py) while a replay logs its steps

    def _make_role(self, role: str) -> None:
        """The role's scheduler over the instance's own blocks: no model reload, no new pool."""
        self.scheduler = self.policies.scheduler(role, self.blocks, self.device, self.clock)
        self.dispatcher = self.policies.dispatcher() if role == "prefill" else None
        self.role = role

    # ---- the step loop ------------------------------------------------------------------
    async def warm_up(self) -> None:
        """The device's warm-up (``Device.warm_up``) in two of this instance's blocks, given back
        after; before the step loop serves anything."""
        blocks = self.blocks.allocate(2)
        try:
            await self.device.warm_up(blocks)
        finally:
            self.blocks.free(blocks)

    def start(self) -> None:
        self.wake = asyncio.Event()
        self.task = asyncio.create_task(self._guarded(), name=f"instance-{self.id}")

    async def _guarded(self) -> None:
        """Run the loop; a step that raises (or any bug in the loop) fails the instance, and the
        host moves its requests elsewhere instead of losing them."""
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - every failure must reach the control plane
            self.host.on_failure(self, f"{type(e).__name__}: {e}")

    async def _loop(self) -> None:
        while True:
            plan = self.scheduler.schedule()
            if plan.empty:
                await self._idle()
                continue
            out = await (self.device.execute(plan) if self.step_log is None else self._logged(plan, self.step_log))
            events = self.scheduler.update(plan, out)
            self._account(plan, out)
            finished = {}
            for req in events.tokens:
                reason = self.stops.check(req)
                if reason:
                    self.scheduler.finish(req, reason)
                    finished[req.request_id] = reason
            report = StepReport(tuple((r, finished.get(r.request_id)) for r in events.tokens),
                                tuple(r for r in events.prefilled if r.request_id not in finished),
                                out.features, out.num_tokens, out.logprobs, out.prompt_logprobs)
            self.host.on_step(self, report)

    async def _logged(self, plan: StepPlan, log) -> StepOutput:
        """The step, timed into the step log (no line for a step that raises or is cancelled, or
        that ends after the log was taken away: the replay's counters no longer include it)."""
        token, cpu0, out = log.begin(self.id), self.device.cpu_s, None
        try:
            out = await self.device.execute(plan)
            return out
        finally:
            log.end(self.id, self.role, plan, out if self.step_log is log else None, self.device.cpu_s - cpu0, token)

    def _account(self, plan: StepPlan, out: StepOutput) -> None:
        self.busy_s += out.busy_s
        self.busy_by_role[self.role] += out.busy_s
        self.num_steps += 1
        self.num_preemptions += len(plan.preempted_ids)
        if self.scheduler.role == "prefill":  # a prefill-only scheduler: every row is prompt work
            self.num_prefill_tokens += plan.num_real_tokens
            self.num_pad_tokens += plan.num_pad_tokens
        else:  # rows beyond the sampled ones are prompt work (chunks, recomputes)
            self.num_decode_tokens += len(out.sampled)
            self.num_prefill_tokens += plan.num_real_tokens - len(out.sampled)

    @property
    def is_running(self) -> bool:
        """The step loop is alive (started, not halted, not died)."""
        return self.task is not None and not self.task.done()

    def notify(self) -> None:
        if self.wake is not None:
            self.wake.set()

    async def _idle(self) -> None:
        """Wait for work; meanwhile the device's cores may serve other instances' steps."""
        self.wake.clear()
        self.device.set_idle(True)
        try:
            await self.wake.wait()
        finally:
            self.device.set_idle(False)

    async def halt(self) -> None:
        """Stop the loop (a step already on the device runs to its end unseen)."""
        if self.task and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        # a cancelled task keeps its exception, whose frames hold this instance: without this the
        # instance, its device and its KV pool would live on as a cycle until a full GC
        self.task = None

    async def stop(self) -> None:
        await self.halt()
        await self.device.close()

    async def switch_role(self, role: str) -> None:
        """The flip itself, once drained: halt the idle loop, swap the scheduler, start again."""
        assert self.num_requests == 0, f"instance {self.id} still holds requests"
        await self.halt()
        self._make_role(role)
        self.num_flips += 1
        self.start()

    def change_role_live(self, role: str) -> None:
        """An adaptive instance's flip: no drain, no new scheduler. Its requests stay; from now
        on its finished prompts are handed over (prefill) or decode here (decode)."""
        self._adaptive().set_hand_over(role == "prefill", self.policies.role_budget(role))
        self.dispatcher = self.policies.dispatcher() if role == "prefill" else None
        self.role = role
        self.num_flips += 1
        self.notify()

    def inject_fault(self) -> None:
        """Make the next step raise, as a device error would (fault-injection drills and tests)."""
        self.device.fail_next_step()

    # ---- façade: what the host may ask of the scheduler ---------------------------------------
    @property
    def adaptive(self) -> Optional[Adaptive]:
        """Its scheduler as adaptive mode's (prompts and decodes, kept or handed over), or None."""
        return self.scheduler.as_adaptive()

    def _adaptive(self) -> Adaptive:
        return self._part(self.scheduler.as_adaptive(), "an adaptive instance's")

    def _sender(self) -> KVSender:
        return self._part(self.scheduler.as_sender(), "a prefill or adaptive instance's")

    def _receiver(self) -> KVReceiver:
        return self._part(self.scheduler.as_receiver(), "a decode or adaptive instance's")

    def _part(self, part, what: str):
        if part is None:
            raise TypeError(f"instance {self.id} is a {self.role} instance: that call is {what}")
        return part

    def submit(self, req: Request) -> None:
        """A request enters (prefill, coupled: its prompt; decode: a request whose KV is lost
        elsewhere, recomputed here)."""
        self.scheduler.add_request(req)
        self.notify()

    def abort(self, request_id: str) -> Optional[Request]:
        req = self.scheduler.abort(request_id)
        self.notify()
        return req

    def take_unstarted(self, request_ids=None) -> list[Request]:
        """Prefill (and adaptive): queued requests no chunk has touched yet (a draining instance
        hands them on; adaptive: ``request_ids``, those another instance takes)."""
        if request_ids is not None:
            return self._adaptive().take_unstarted(request_ids)
        return self._sender().take_unstarted()

    def release_kv(self, request_id: str) -> None:
        """Prefill (and adaptive): the KV was handed over; free its blocks here."""
        self._sender().release(request_id)
        self.notify()

    def keep_kv(self, request_id: str) -> None:
        """Adaptive: a prompt this instance prefilled decodes here instead of being handed over."""
        self._adaptive().keep(request_id)
        self.notify()

    def migrate_decodes(self, request_ids: Optional[Collection[str]] = None) -> list[str]:
        """Adaptive: its running decodes (those of ``request_ids``, if given) leave after their
        next token, by a KV hand-over."""
        ids = self._adaptive().mark_migrating(request_ids)
        self.notify()
        return ids

    def choose_decode(self, req: Request) -> str:
        """Prefill: the decode instance its dispatcher picks (``NoDecodeInstance`` if none)."""
        return self.dispatcher.choose(req)

    def set_decode_loads(self, loads: list[DecodeLoad]) -> None:
        if self.dispatcher is not None:
            self.dispatcher.update_loads(loads)

    def reserve_kv(self, req: Request) -> Optional[list[int]]:
        """Decode: blocks for ``req``'s prompt KV before it is sent; None: not now."""
        return self._receiver().allocate_incoming(req)

    def kv_room(self) -> int:
        """Decode: blocks a hand-over may reserve now (-1: none, a preempted request waits)."""
        return self._receiver().incoming_room()

    def accept_kv(self, req: Request) -> None:
        """Decode: the KV arrived in the reserved blocks; the request joins the queue."""
        self._receiver().accept_incoming(req)
        self.notify()

    def reclaim_kv(self, lease_s: float, keep) -> list[str]:
        """Decode: free reservations older than ``lease_s`` whose KV never came."""
        return self._receiver().reclaim_incoming(lease_s, keep)

    def reserves_kv_for(self, request_id: str) -> bool:
        receiver = self.scheduler.as_receiver()
        return receiver is not None and request_id in receiver.incoming_ids

    def decode_load(self) -> DecodeLoad:
        return self._receiver().load(self.id)

    # ---- views ------------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return self.scheduler.num_requests

    @property
    def num_queued_tokens(self) -> int:
        """Load for the global scheduler: prompt tokens waiting on this instance."""
        return self.scheduler.num_queued_tokens

    def kv_outlook(self, expected_output_tokens: int, floor: Optional[int] = None) -> int:
        """KV blocks a new prompt would find here while this instance's requests decode, at least
        ``floor`` (``Scheduler.kv_outlook``)."""
        return self.scheduler.kv_outlook(expected_output_tokens, floor)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a step (decode: for a batch slot; preempted ones included)."""
        return self.scheduler.queue_lengths()[0]

    @property
    def num_running(self) -> int:
        """Requests in the running batch (its scheduler's count: no walk of the queues)."""
        return self.scheduler.queue_lengths()[1]

    def snapshot(self) -> dict:
        """This instance's row of ``/v1/stats`` (plain JSON values)."""
        sched, receiver = self.scheduler, self.scheduler.as_receiver()
        waiting, running = sched.queue_lengths()
        return {
            "id": self.id, "role": self.role, "state": self.state, "device": self.device.kind,
            "free_blocks": self.blocks.num_free, "total_blocks": self.blocks.num_blocks,
            "block_size": self.blocks.block_size, "num_waiting": waiting, "num_running": running,
            "num_requests": self.num_requests, "queued_tokens": self.num_queued_tokens, "num_steps": self.num_steps,
            "num_prefill_tokens": self.num_prefill_tokens, "num_decode_tokens": self.num_decode_tokens,
            "num_pad_tokens": self.num_pad_tokens, "busy_s": self.busy_s, "num_flips": self.num_flips,
            "failure": self.failure, "num_preemptions": self.num_preemptions,
            # prefix caching (scheduling/prefix.py): prompt tokens looked up and found, blocks kept cached
            "prefix_cache_queries": self.blocks.num_query_tokens, "prefix_cache_hits": self.blocks.num_hit_tokens,
            "cached_blocks": self.blocks.num_cached, "prefix_cache_evictions": self.blocks.num_evictions,
            # the monitor's per-stage counts; None where the role has no such stage
            "num_scheduled": len(sched.scheduled_ids) if sched.role == "prefill" else None,
            "num_receiving": len(receiver.incoming_ids) if receiver is not None else None,
        }
