"""The control plane: instances, the global scheduler, the request table, the cluster monitor.

    submit() --least-loaded--> prefill instance --chunks--> on_prefill_done
                                   |  dispatcher (decode loads as last broadcast)
                                   v
                      KVLink.write (real copy + emulated wait) --> decode instance --> on_token
    monitor task: every monitor_interval_s collect decode loads, broadcast to prefill dispatchers

In ``coupled`` mode every instance does both phases with its batching policy and the global
scheduler picks the least-loaded one. Everything here runs on the event-loop thread.

The length predictor (aserve/online_predictor.py) starts at submit and runs on its own thread;
its range is put on the request where a policy first reads it: the handoff (disagg, parallel),
or before placement (sequential mode; coupled alise). ``_finish`` scores it and feeds it back.
"""
from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import torch

from aserve.config import ClusterConfig, EngineConfig
from aserve.engine import ModelBundle
from aserve.instance import Instance
from aserve.lifecycle import LifecycleMixin
from aserve.online_predictor import OnlinePredictor
from aserve.output import StopChecker
from netemu import KVEmulation, KVLink, parse_link
from netemu.transfer import TransferError
from scheduling.clock import Clock, MonotonicClock
from scheduling.dispatch import NoDecodeInstance
from scheduling.request import Request, SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    token_id: Optional[int]  # None on a final event that carries no token (abort, error)
    finished: bool = False
    finish_reason: Optional[str] = None
    error: Optional[str] = None


@dataclass
class Handle:
    """A request's row in the request table."""

    request: Request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    instance_id: Optional[str] = None
    phase: str = "queued"  # queued | prefill | transfer | decode | done
    aborted: bool = False
    token_times: list = field(default_factory=list)
    prefill_instance: Optional[str] = None
    decode_instance: Optional[str] = None
    epoch: int = 0  # bumped when the request is re-run elsewhere: stale handoffs see it and stop


class Cluster(LifecycleMixin):
    def __init__(self, engine: EngineConfig, cfg: ClusterConfig, bundle: Optional[ModelBundle] = None,
                 clock: Optional[Clock] = None):
        self.engine, self.cfg = engine, cfg
        self.clock = clock or MonotonicClock()
        self.bundle = bundle
        self.instances: dict[str, Instance] = {}
        self.requests: dict[str, Handle] = {}
        self.links: dict[tuple[str, str], KVLink] = {}
        self.link_profile = parse_link(cfg.link)
        self.emulation = KVEmulation.from_args(cfg.emulate_model, cfg.emulate_kv_bytes_per_token)
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._monitor: Optional[asyncio.Task] = None
        self.loop_lag_s = 0.0
        self.counts = {"finished": 0, "aborted": 0, "failed": 0}
        self.started = False
        self.predictor = OnlinePredictor(cfg)
        self._init_lifecycle()

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self.bundle is None:
            self.bundle = await asyncio.to_thread(ModelBundle.load, self.engine)
        self.stops = StopChecker(self.bundle.tokenizer, self.bundle.eos_token_ids)
        # loading (or fitting, the first time) a predictor takes seconds: off the loop
        await asyncio.to_thread(self.predictor.load, self.bundle.tokenizer.decode, (self.engine.model, self.bundle.path),
                                self._prediction_gate() == "handoff")
        roles = (["prefill"] * self.cfg.num_prefill + ["decode"] * self.cfg.num_decode
                 if self.cfg.mode == "disagg" else ["coupled"] * self.cfg.num_coupled)
        threads = self._threads_per_instance(len(roles))
        for i, role in enumerate(roles):
            self._add_instance(f"{role[0]}{i}", role, threads)
        self._next_instance = len(roles)
        self._broadcast()
        self._monitor = asyncio.create_task(self._monitor_loop(), name="cluster-monitor")
        self._start_watcher()
        self.started = True

    def _threads_per_instance(self, n: int) -> int:
        return max(1, self._cores() // n)

    def _cores(self) -> int:
        return self.engine.num_threads or os.cpu_count() or 1

    def device_slowdown(self) -> float:
        """How much slower than one borrowed core an instance's emulated device is.

        ``device_share="dedicated"`` emulates the paper's setting, where each instance owns its
        accelerator, on a CPU with fewer cores than instances: every live instance owns
        ``cores / N`` of a core, so a step that used ``c`` CPU seconds occupies the instance for
        ``c * N / cores`` seconds (the instance waits out the difference) and the share of an
        idle instance is lost instead of going to busy ones. CPU seconds, not wall seconds, so
        time-slicing with other instances is not charged twice. 1.0 (no emulation) when shared,
        on CUDA, or with a core (or more) per instance."""
        if self.cfg.device_share != "dedicated" or self.engine.device != "cpu":
            return 1.0
        live = sum(i.state not in ("failed", "removed") for i in self.instances.values())
        return max(1.0, live / self._cores())

    def _add_instance(self, iid: str, role: str, threads: int) -> Instance:
        inst = Instance(iid, role, self.bundle, self.engine, self.cfg, self, self.engine.device, threads)
        self.instances[iid] = inst
        inst.start()
        return inst

    async def stop(self) -> None:
        for rid in list(self.requests):
            self.abort(rid)
        for task in (self._monitor, self._watcher):
            if task:
                task.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for inst in self.instances.values():
            await inst.stop()
        await asyncio.to_thread(self.predictor.close)
        self.started = False

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.stop()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- monitor ---------------------------------------------------------------------------
    async def _monitor_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.cfg.monitor_interval_s
        while True:
            t0 = loop.time()
            await asyncio.sleep(interval)
            self.loop_lag_s = max(0.0, loop.time() - t0 - interval)
            self._broadcast()
            self._reclaim_leases()

    def _broadcast(self) -> None:
        """Collect decode instances' loads and hand them to every prefill dispatcher."""
        loads = [i.decode.load(i.id) for i in self.instances.values() if i.role == "decode" and i.state == "active"]
        for inst in self.instances.values():
            if inst.role == "prefill":
                inst.dispatcher.update_loads(loads)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams = SamplingParams(),
               request_id: Optional[str] = None, prompt_text: str = "",
               oracle_length: Optional[int] = None) -> Handle:
        """Enter a request: it goes to the least-loaded prefill (or coupled) instance.
        ``oracle_length`` (replay knows it) is the true output length the ``oracle`` predictor reads."""
        assert self.started, "start the cluster first"
        self.bundle.check_fits(len(prompt_token_ids), sampling.max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        req = Request(rid, list(prompt_token_ids), sampling, arrival_time=self.clock.now(), prompt_text=prompt_text)
        if oracle_length is not None:
            req.oracle_length = oracle_length  # predictors.simple.ORACLE_ATTR
        self._check_capacity(req)
        req.times["arrival"] = req.arrival_time
        handle = Handle(req)
        self.requests[rid] = handle
        self.predictor.start(req)
        if not self.predictor.try_attach(req):  # not ready at once (none and oracle are): on its thread
            gate = self._prediction_gate()
            if gate == "place":
                self._spawn(self._place_when_predicted(handle))
                return handle
            if gate == "background":
                self._spawn(self.predictor.attach(req))
        if not self._place(handle):
            self._finish(handle, "error", error="no instance can take new requests")
        return handle

    def _prediction_gate(self) -> str:
        """Where a request's predicted range must be on it: ``place`` before it enters a queue
        (sequential mode: the prediction adds to TTFT; coupled alise, whose ranking reads it at
        add), ``handoff`` before dispatch (disagg, parallel: it overlaps the prefill), or
        ``background`` (coupled vllm/sarathi read no prediction: it is only scored)."""
        if self.cfg.predictor_mode == "sequential" or (self.cfg.mode == "coupled" and self.engine.batching == "alise"):
            return "place"
        return "background" if self.cfg.mode == "coupled" else "handoff"

    async def _place_when_predicted(self, handle: Handle) -> None:
        await self.predictor.attach(handle.request)
        if handle.phase != "queued":  # aborted while its length was being predicted
            return
        if not self._place(handle):
            self._finish(handle, "error", error="no instance can take new requests")

    def _place(self, handle: Handle) -> bool:
        """Send a request with no KV anywhere to the least-loaded active entry instance (prefill
        or coupled). A request that already streamed tokens and has no coupled instance to go to
        is adopted by a decode instance, which recomputes its prompt + output in one step."""
        req = handle.request
        entry = [i for i in self.instances.values() if i.role in ("prefill", "coupled") and i.state == "active"]
        if entry and not (req.output_token_ids and entry[0].role == "prefill"):
            inst = min(entry, key=lambda i: (i.queued_tokens(), i.id))
            handle.instance_id, handle.phase = inst.id, "prefill"
            if inst.role == "prefill":
                handle.prefill_instance = inst.id
                inst.prefill.add_request(req)
            else:
                inst.coupled.add(req)
        else:
            decode = [i for i in self.instances.values() if i.role == "decode" and i.state == "active"]
            if not decode:
                return False
            inst = min(decode, key=lambda i: (i.holds(), i.id))
            handle.instance_id, handle.decode_instance, handle.phase = inst.id, inst.id, "decode"
            inst.decode.adopt(req)
        inst.notify()
        return True

    def _check_capacity(self, req: Request) -> None:
        """Refuse, before the request enters the table, what no instance's KV pool could ever hold."""
        need = -(-(req.max_total_tokens() + 1) // self.engine.block_size)
        largest = max((i.blocks.num_blocks for i in self.instances.values()), default=0)
        if need > largest:
            raise ValueError(f"prompt plus max_tokens needs {need} KV blocks; the largest instance has {largest}")

    async def stream(self, handle: Handle) -> AsyncIterator[TokenEvent]:
        """Token events of one request until its final event; abort it if the consumer goes away."""
        try:
            while True:
                ev = await handle.queue.get()
                yield ev
                if ev.finished:
                    return
        finally:
            if handle.phase != "done":
                self.abort(handle.request.request_id)

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams = SamplingParams(),
                       request_id: Optional[str] = None) -> Request:
        handle = self.submit(prompt_token_ids, sampling, request_id)
        async for _ in self.stream(handle):
            pass
        return handle.request

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is and free its blocks on every instance."""
        handle = self.requests.get(request_id)
        if handle is None or handle.phase == "done":
            return False
        handle.aborted = True
        if handle.phase == "transfer":
            return True  # the handoff task sees the flag and frees both sides
        inst = self.instances.get(handle.instance_id)
        if inst is not None:
            sched = inst.prefill or inst.decode or inst.coupled
            sched.abort(request_id)
            inst.notify()
        self._finish(handle, "abort")
        return True

    # ---- callbacks from instances ------------------------------------------------------------
    def stop_reason(self, req: Request) -> Optional[str]:
        return self.stops.check(req)

    def would_stop(self, request_id: str, token_id: int) -> bool:
        handle = self.requests.get(request_id)
        if handle is None:  # aborted while the step ran: the scheduler's update skips it
            return False
        req = handle.request
        req.output_token_ids.append(token_id)
        try:
            return self.stops.check(req) is not None
        finally:
            req.output_token_ids.pop()

    def on_token(self, inst: Instance, request_id: str, finished: bool) -> None:
        handle = self.requests.get(request_id)
        if handle is None or handle.phase == "done":
            return
        req = handle.request
        now = self.clock.now()
        req.times.setdefault("first_token", now)
        handle.token_times.append(now)
        handle.queue.put_nowait(TokenEvent(req.output_token_ids[-1]))
        if finished:
            self._finish(handle, self.stops.check(req) or "stop")

    def on_prefill_done(self, inst: Instance, req: Request) -> None:
        handle = self.requests.get(req.request_id)
        if handle is None or handle.phase == "done":
            return
        self.on_token(inst, req.request_id, finished=False)
        reason = self.stops.check(req)
        if reason:  # done at its first token: nothing to hand over
            inst.prefill.release(req.request_id)
            self._finish(handle, reason)
            return
        handle.phase = "transfer"
        self._spawn(self._handoff(inst, handle))

    async def _handoff(self, src: Instance, handle: Handle) -> None:
        """Move the request's KV from ``src`` to a decode instance the dispatcher picks.

        A transfer that fails or times out frees the blocks reserved on the receiver and is
        retried on another decode instance (``transfer_retries`` times, then the request is
        re-run from its prompt). If ``src`` fails meanwhile the request has already been re-run
        (its epoch moved on) and this task only cleans up after itself."""
        req, epoch = handle.request, handle.epoch
        rid = req.request_id
        await self.predictor.attach(req)  # parallel mode: the dispatcher and decode policies read it
        tried: set[str] = set()
        failures = 0
        src.num_transfers_out += 1
        try:
            while True:
                if handle.epoch != epoch:
                    return
                if handle.aborted:
                    src.prefill.abort(rid)
                    self._finish(handle, "abort")
                    return
                dst = self._pick_decode(src, req, tried)
                dst_blocks = dst.decode.allocate_incoming(req) if dst is not None else None
                if dst_blocks is None:
                    if tried and dst is None:
                        tried.clear()  # every decode instance failed us once: try them all again
                    await asyncio.sleep(self.cfg.monitor_interval_s / 10)  # every decode instance is full
                    continue
                ok = await self._transfer(src, dst, handle, dst_blocks)
                if handle.epoch != epoch:  # src failed during the copy: re-run elsewhere, and
                    return  # _rerun freed this reservation (the copy itself ran inline: no writer left)
                if ok and dst.state in ("active", "draining"):  # draining: it finishes what it holds
                    break
                dst.decode.abort(rid)  # frees what was reserved there (a dead instance: harmless)
                tried.add(dst.id)
                failures += 1
                self.log_event("transfer_retry", dst.id, f"{rid}: KV transfer to {dst.id} failed, retry {failures}")
                self.counts["transfer_retries"] += 1
                if failures > self.cfg.transfer_retries:
                    src.prefill.abort(rid)
                    self._rerun(handle, f"KV transfer failed {failures} times")
                    return
        finally:
            src.num_transfers_out -= 1
        src.prefill.release(rid)
        if handle.aborted:
            dst.decode.abort(rid)
            self._finish(handle, "abort")
            return
        dst.decode.add_request(req)
        handle.instance_id, handle.decode_instance, handle.phase = dst.id, dst.id, "decode"
        dst.notify()
        src.notify()

    def _pick_decode(self, src: Instance, req: Request, tried: set) -> Optional[Instance]:
        try:
            dst = self.instances.get(src.dispatcher.choose(req))
        except NoDecodeInstance:
            return None
        if dst is None or dst.state != "active" or dst.role != "decode":
            return None  # the view is up to one broadcast old
        if dst.id in tried:
            others = [i for i in self.instances.values()
                      if i.role == "decode" and i.state == "active" and i.id not in tried]
            return min(others, key=lambda i: (i.holds(), i.id)) if others else None
        return dst

    async def _transfer(self, src: Instance, dst: Instance, handle: Handle, dst_blocks: list[int]) -> bool:
        """One KV copy over the link, bounded by ``transfer_timeout_s``; False if it failed."""
        req = handle.request
        req.times["transfer_start"] = self.clock.now()
        dst.num_transfers_in += 1
        link = self._link(src, dst)
        if self._transfer_faults:
            self._transfer_faults -= 1
            link.fail_next(1)
        try:
            record = await asyncio.wait_for(
                link.write(req.request_id, src.runner.kv.pool, list(req.block_ids),
                                           dst.runner.kv.pool, dst_blocks, num_tokens=req.num_computed_tokens),
                self.cfg.transfer_timeout_s)
        except (TransferError, asyncio.TimeoutError) as e:
            req.times["transfer_error"] = f"{type(e).__name__}: {e}"
            return False
        finally:
            dst.num_transfers_in -= 1
        req.times["transfer_end"] = self.clock.now()
        req.times["transfer_real_s"] = record.real_copy_s
        return True

    def _link(self, src: Instance, dst: Instance) -> KVLink:
        key = (src.id, dst.id)
        if key not in self.links:
            self.links[key] = KVLink(self.link_profile, self.clock, emulation=self.emulation)
        return self.links[key]

    def _finish(self, handle: Handle, reason: str, error: Optional[str] = None) -> None:
        req = handle.request
        req.finish_reason, req.error = reason, error
        req.times["finish"] = self.clock.now()
        handle.phase = "done"
        self.predictor.finish(req)
        key = {"abort": "aborted", "error": "failed"}.get(reason, "finished")
        if error:
            self.log_event("request_failed", handle.instance_id, f"{req.request_id}: {error}")
        self.counts[key] += 1
        handle.queue.put_nowait(TokenEvent(None, True, reason, error))
        self.requests.pop(req.request_id, None)

    # ---- views -------------------------------------------------------------------------------
    def free_blocks(self) -> dict[str, int]:
        return {iid: inst.blocks.num_free for iid, inst in self.instances.items()}

    def total_blocks(self) -> dict[str, int]:
        return {iid: inst.blocks.num_blocks for iid, inst in self.instances.items()}
