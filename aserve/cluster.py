"""The control plane: instances, the global scheduler, the request table, the cluster monitor.

    submit() --least-loaded--> prefill instance --chunks--> on_prefill_done
                                   |  dispatcher (decode loads as last broadcast)
                                   v
                      KVLink.write (real copy + emulated wait) --> decode instance --> on_token
    monitor task: every monitor_interval_s collect decode loads, broadcast to prefill dispatchers

In ``coupled`` mode every instance does both phases with its batching policy and the global
scheduler picks the least-loaded one. Everything here runs on the event-loop thread.
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
from aserve.output import StopChecker
from netemu import KVEmulation, KVLink, parse_link
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


class Cluster:
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

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self.bundle is None:
            self.bundle = await asyncio.to_thread(ModelBundle.load, self.engine)
        self.stops = StopChecker(self.bundle.tokenizer, self.bundle.eos_token_ids)
        roles = (["prefill"] * self.cfg.num_prefill + ["decode"] * self.cfg.num_decode
                 if self.cfg.mode == "disagg" else ["coupled"] * self.cfg.num_coupled)
        threads = self._threads_per_instance(len(roles))
        for i, role in enumerate(roles):
            self._add_instance(f"{role[0]}{i}", role, threads)
        self._broadcast()
        self._monitor = asyncio.create_task(self._monitor_loop(), name="cluster-monitor")
        self.started = True

    def _threads_per_instance(self, n: int) -> int:
        cores = self.engine.num_threads or os.cpu_count() or 1
        return max(1, cores // n)

    def _add_instance(self, iid: str, role: str, threads: int) -> Instance:
        inst = Instance(iid, role, self.bundle, self.engine, self.cfg, self, self.engine.device, threads)
        self.instances[iid] = inst
        inst.start()
        return inst

    async def stop(self) -> None:
        for rid in list(self.requests):
            self.abort(rid)
        if self._monitor:
            self._monitor.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for inst in self.instances.values():
            await inst.stop()
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

    def _broadcast(self) -> None:
        """Collect decode instances' loads and hand them to every prefill dispatcher."""
        loads = [i.decode.load(i.id) for i in self.instances.values() if i.role == "decode" and i.state == "active"]
        for inst in self.instances.values():
            if inst.role == "prefill":
                inst.dispatcher.update_loads(loads)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams = SamplingParams(),
               request_id: Optional[str] = None, prompt_text: str = "") -> Handle:
        """Enter a request: it goes to the least-loaded prefill (or coupled) instance."""
        assert self.started, "start the cluster first"
        self.bundle.check_fits(len(prompt_token_ids), sampling.max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        req = Request(rid, list(prompt_token_ids), sampling, arrival_time=self.clock.now(), prompt_text=prompt_text)
        self._check_capacity(req)
        req.times["arrival"] = req.arrival_time
        handle = Handle(req)
        self.requests[rid] = handle
        entry = [i for i in self.instances.values() if i.role in ("prefill", "coupled") and i.state == "active"]
        if not entry:
            self._finish(handle, "error", error="no instance can take new requests")
            return handle
        inst = min(entry, key=lambda i: (i.queued_tokens(), i.id))
        handle.instance_id, handle.phase = inst.id, "prefill"
        if inst.role == "prefill":
            handle.prefill_instance = inst.id
            inst.prefill.add_request(req)
        else:
            inst.coupled.add(req)
        inst.notify()
        return handle

    def _check_capacity(self, req: Request) -> None:
        """Refuse, before the request enters the table, what no instance's KV pool could ever hold."""
        need = -(-(req.max_total_tokens() + 1) // self.engine.block_size)
        largest = max(i.blocks.num_blocks for i in self.instances.values())
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
        req = handle.request
        rid = req.request_id
        while True:
            if handle.aborted:
                src.prefill.abort(rid)
                self._finish(handle, "abort")
                return
            try:
                dst = self.instances[src.dispatcher.choose(req)]
            except NoDecodeInstance:
                dst = None
            dst_blocks = dst.decode.allocate_incoming(req) if dst is not None else None
            if dst_blocks is not None:
                break
            await asyncio.sleep(self.cfg.monitor_interval_s / 10)  # every decode instance is full: wait
        req.times["transfer_start"] = self.clock.now()
        link = self._link(src, dst)
        record = await link.write(rid, src.runner.kv.pool, list(req.block_ids), dst.runner.kv.pool, dst_blocks,
                                  num_tokens=req.num_computed_tokens)
        req.times["transfer_end"] = self.clock.now()
        req.times["transfer_real_s"] = record.real_copy_s
        src.prefill.release(rid)
        if handle.aborted:
            dst.decode.abort(rid)
            self._finish(handle, "abort")
            return
        dst.decode.add_request(req)
        handle.instance_id, handle.decode_instance, handle.phase = dst.id, dst.id, "decode"
        dst.notify()
        src.notify()

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
        key = {"abort": "aborted", "error": "failed"}.get(reason, "finished")
        self.counts[key] += 1
        handle.queue.put_nowait(TokenEvent(None, True, reason, error))
        self.requests.pop(req.request_id, None)

    # ---- views -------------------------------------------------------------------------------
    def free_blocks(self) -> dict[str, int]:
        return {iid: inst.blocks.num_free for iid, inst in self.instances.items()}

    def total_blocks(self) -> dict[str, int]:
        return {iid: inst.blocks.num_blocks for iid, inst in self.instances.items()}
