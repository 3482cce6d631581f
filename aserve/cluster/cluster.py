"""The control plane: instances, the global scheduler, the request table, the cluster monitor.

    submit() ─least-loaded─► prefill instance ─chunks─► on_step: prefilled ─► Handoff.run
                                 │ dispatcher (decode loads as last broadcast)      │
                                 ▼                                                  ▼
                        decode instance ◄── KV: src.device.send_kv (real copy + emulated link time)
                                 └─ on_step: tokens ─► the request's queue ─► stream()
    monitor task: every monitor_interval_s collect decode loads, broadcast to prefill dispatchers

In ``coupled`` mode every instance does both phases with its batching policy and the global
scheduler picks the least-loaded one. In ``adaptive`` mode every instance can prefill in chunks
beside its decodes (scheduling/hybrid.py): the global scheduler (scheduling/placement.py) sends a
prompt to the instance where it costs least, a decode instance included (its KV then never
moves), and a prefill instance keeps decoding what it prefilled unless moving it pays
(``Placement.keep_local``). The placement is late-bound: after each step, the instance that
stepped takes the oldest prompts others have not started while they cost less there (a decode
instance that had no room for them when they arrived may have it now); once arrivals stop, running
decodes are rebalanced by KV migration. Those decisions are aserve/cluster/adaptive.py's
(``AdaptivePlacer``); the cluster calls it where a request's life reaches one. Everything here runs
on the event-loop thread.

The cluster is every instance's ``InstanceHost``: instances report once a step (``on_step``) or
when they fail (``on_failure``), and the cluster reaches them through their façade. Lifecycle
(flips, adds, removals, failures), the KV hand-over and adaptive placement are composed parts with
their own state.

The length predictor (aserve/predict/online.py) starts at submit and runs on its own thread;
its range is put on the request where a policy first reads it: the handoff (disagg, parallel),
or before placement (sequential mode; coupled alise). ``finish`` scores it and feeds it back.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import AsyncIterator, Optional

from aserve.cluster.adaptive import AdaptivePlacer
from aserve.cluster.groups import PrefixGroups
from aserve.cluster.handoff import Handoff
from aserve.cluster.lifecycle import Lifecycle
from aserve.cluster.requests import EventLog, RequestHandle, TokenEvent
from aserve.config import ClusterConfig, EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.devices.cores import lender_for
from aserve.devices.device import CoreShare, Device
from aserve.devices.factory import DeviceFactory, load_bundle
from aserve.devices.measured import resolve, step_room
from aserve.engine.instance import Instance, StepReport
from aserve.engine.policies import Policies
from aserve.engine.stops import StopChecker
from aserve.event_loop import overslept
from aserve.predict.online import OnlinePredictor
from scheduling.clock import Clock, MonotonicClock
from scheduling.hybrid import HybridScheduler
from scheduling.placement import entry_key
from scheduling.prefix import cached_prefix_tokens
from scheduling.request import Request, SamplingParams
from scheduling.step import TokenLogprobs

class Cluster:
    def __init__(self, engine: EngineConfig, cfg: ClusterConfig, bundle: Optional[ModelBundle] = None,
                 clock: Optional[Clock] = None):
        engine, cfg = resolve(engine, cfg)  # measured defaults left unset: filled in now, once
        self.engine, self.cfg = engine, cfg
        self.clock = clock or MonotonicClock()
        self.bundle = bundle
        self.policies = Policies.from_configs(engine, cfg, step_room(engine, cfg))
        self.instances: dict[str, Instance] = {}
        self.requests: dict[str, RequestHandle] = {}
        self.log = EventLog()
        self.counts = {"finished": 0, "aborted": 0, "failed": 0}
        self._outputs_seen = (0, 0)  # (requests finished, their output tokens): mean_output_tokens
        self.devices = DeviceFactory(engine, cfg)  # which device each instance gets, and Ray's connection
        cores = self.devices.cores()
        self.core_share = CoreShare(cfg.device_share == "dedicated" and engine.device == "cpu", cores,
                                    lender=lender_for(cfg.device_share, engine.device, cores)
                                    if cfg.backend == "local" else None)
        self.lifecycle = Lifecycle(cfg, self.clock, self.log, self)
        self.handoff = Handoff(cfg, self.clock, self.log, self.instances, self.finish, self.lifecycle.rerun,
                               self.lifecycle.recompute, spawn=self.spawn)
        self.predictor = OnlinePredictor(cfg)
        self.groups = PrefixGroups()  # the n choices of a prompt held until the first has computed it
        self.placer = AdaptivePlacer(engine, cfg, self.clock, self.instances, self.requests, self.handoff)
        self.stops: Optional[StopChecker] = None
        self.loop_lag_s = 0.0
        self.started = False
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._monitor: Optional[asyncio.Task] = None
        self.step_log = None  # a StepLog every instance writes its steps to (aserve replay --step-log)

    @property
    def placements(self) -> dict[str, int]:
        """Adaptive: where prompts went (prefill, decode), kept, taken by late binding, moved."""
        return self.placer.placements

    @property
    def placement(self):
        return self.placer.placement

    # ---- start and stop ----------------------------------------------------------------------
    async def start(self, warm_up: bool = False) -> None:
        """Load the model, start the instances (and their devices) and the monitor. ``warm_up``:
        each instance's device runs a first step's work once before anything is served (serve)."""
        if self.bundle is None:  # on Ray the driver holds no weights: each actor loads its own
            self.bundle = await asyncio.to_thread(load_bundle, self.engine, self.devices.local)
        self.stops = StopChecker(self.bundle.tokenizer, self.bundle.eos_token_ids)
        # loading (or fitting, the first time) a predictor takes seconds: off the loop
        await asyncio.to_thread(self.predictor.load, self.bundle.tokenizer.decode, (self.engine.model, self.bundle.path),
                                self._prediction_gate() == "handoff")
        self.devices.start(self.bundle, self._roles())
        self.lifecycle.start(self._roles())
        try:  # remote devices: every actor up with its model loaded before the first request
            await asyncio.gather(*(inst.device.ready() for inst in self.instances.values()))
            if warm_up:
                await asyncio.gather(*(inst.warm_up() for inst in self.instances.values()))
        except BaseException:
            await self.stop()
            raise
        self.broadcast()
        self._monitor = asyncio.create_task(self._monitor_loop(), name="cluster-monitor")
        self.started = True

    def device_lines(self) -> list[str]:
        """A start-up line per instance's device (``Device.describe``)."""
        return [inst.device.describe() for inst in self.instances.values()]

    async def stop(self, wait_s: Optional[float] = None) -> None:
        """Abort every request, stop every instance (at once) and free its device. ``wait_s``:
        how long to wait for the steps, copies and predictions still running on their threads
        (None: as long as they take); what overruns it is left to end unseen (a server's bounded
        exit; nothing it could write is read again)."""
        for rid in list(self.requests):
            self.abort(rid)
        self.lifecycle.stop()
        if self._monitor:
            self._monitor.cancel()
        for t in list(self._tasks):
            t.cancel()
        loop = asyncio.get_running_loop()
        deadline = None if wait_s is None else loop.time() + wait_s
        left = lambda: None if deadline is None else max(0.0, deadline - loop.time())  # noqa: E731
        work = [asyncio.ensure_future(inst.stop()) for inst in self.instances.values()]
        if self._tasks:
            work.append(asyncio.ensure_future(asyncio.gather(*self._tasks, return_exceptions=True)))
        if work:
            done, pending = await asyncio.wait(work, timeout=left())
            if pending:
                self.log.log("stop_overran", None, f"{len(pending)} device or hand-over tasks still running")
            for task in done:  # an instance that failed to stop: logged, the others still stop
                if not task.cancelled() and task.exception() is not None:
                    self.log.log("stop_failed", None, repr(task.exception()))
        closing = asyncio.ensure_future(asyncio.to_thread(self.predictor.close))
        await asyncio.wait([closing], timeout=left())
        self.devices.close()
        self.started = False

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.stop()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- instances ---------------------------------------------------------------------------
    def _roles(self) -> list[str]:
        if self.cfg.split:
            return ["prefill"] * self.cfg.num_prefill + ["decode"] * self.cfg.num_decode
        return ["coupled"] * self.cfg.num_coupled

    def threads_per_instance(self, num_instances: int) -> int:
        return max(1, self.devices.cores() // num_instances)

    def new_instance(self, instance_id: str, role: str, num_threads: int,
                     device: Optional[Device] = None) -> Instance:
        """An instance over a fresh device (its own KV pool, the shared weights; ``device`` when
        it was built already, by ``build_device``), started."""
        device = device or self.devices.make(instance_id, role, num_threads, self.core_share, len(self._roles()),
                                             self._num_live())
        inst = Instance(instance_id, role, device, self.policies, self.stops, self.clock, self)
        inst.step_log = self.step_log
        self.instances[instance_id] = inst
        self.count_live()
        device.watch(lambda why: self._device_lost(inst, why))
        inst.start()
        return inst

    async def build_device(self, instance_id: str, role: str, num_threads: int) -> Device:
        """A device for an instance of ``role`` added while the cluster serves (``DeviceFactory.build``)."""
        return await self.devices.build(instance_id, role, num_threads, self.core_share, len(self._roles()),
                                        self._num_live())

    def log_steps(self, log) -> None:
        """From now on every instance, and every one added later, writes its steps to ``log``
        (a ``StepLog``; None stops it)."""
        self.step_log = log
        for inst in self.instances.values():
            inst.step_log = log

    def _device_lost(self, inst: Instance, why: str) -> None:
        """A remote device died on its own (idle, or mid-step): stop its loop, fail it over."""
        if inst.task is not None:
            inst.task.cancel()
        self.on_failure(inst, why)

    def _num_live(self) -> int:
        """Instances neither failed nor removed."""
        return sum(i.state not in ("failed", "removed") for i in self.instances.values())

    def count_live(self) -> None:
        """Keep the core share's count of live instances true."""
        self.core_share.live = self._num_live()

    # ---- monitor -----------------------------------------------------------------------------
    async def _monitor_loop(self) -> None:
        while True:
            self.loop_lag_s = await overslept(self.cfg.monitor_interval_s)
            self.broadcast()
            self.lifecycle.reclaim_leases()

    def broadcast(self) -> None:
        """Collect decode instances' loads and hand them to every prefill dispatcher."""
        loads = [i.decode_load() for i in self.instances.values() if i.role == "decode" and i.state == "active"]
        for inst in self.instances.values():
            if inst.role == "prefill":
                inst.set_decode_loads(loads)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams = SamplingParams(),
               request_id: Optional[str] = None, prompt_text: str = "",
               oracle_length: Optional[int] = None, stream_tokens: bool = True,
               prefix_group: Optional[str] = None, cache_salt: Optional[str] = None) -> RequestHandle:
        """Enter a request: it goes to the least-loaded prefill (or coupled) instance.
        ``oracle_length`` (replay knows it) is the true output length the ``oracle`` predictor reads;
        ``stream_tokens=False``: ``stream`` yields only the final event (``token_times`` has every
        token's time either way). ``prefix_group``: requests of one group have the same prompt
        (the n choices of one API prompt); all but the first wait until the first has computed it,
        then share its blocks (aserve/cluster/groups.py). ``cache_salt``: cached KV blocks are shared
        only between requests of one salt (scheduling/prefix.py)."""
        assert self.started, "start the cluster first"
        self.bundle.check_fits(len(prompt_token_ids), sampling.max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        req = Request(rid, list(prompt_token_ids), sampling, arrival_time=self.clock.now(), prompt_text=prompt_text,
                      prefix_group=prefix_group, cache_salt=cache_salt)
        self.placer.last_arrival = req.arrival_time
        if oracle_length is not None:
            req.oracle_length = oracle_length  # predictors.simple.ORACLE_ATTR
        self._check_capacity(req)
        req.times["arrival"] = req.arrival_time
        handle = RequestHandle(req, stream_tokens=stream_tokens)
        self.requests[rid] = handle
        self.predictor.start(req)
        if not self.groups.hold(handle):  # held: placed when its first sibling has computed the prompt
            self._enter(handle)
        return handle

    def _enter(self, handle: RequestHandle, beside: Optional[Instance] = None) -> None:
        """Place a new request, once its predicted range is on it where a policy reads it at once;
        ``beside``: the instance holding its first sibling's prompt blocks, if it can take it."""
        req = handle.request
        if not self.predictor.try_attach(req):  # not ready at once (none and oracle are): on its thread
            gate = self._prediction_gate()
            if gate == "place":
                self.spawn(self._place_when_predicted(handle, beside))
                return
            if gate == "background":
                self.spawn(self.predictor.attach(req))
        if not self._place_beside(handle, beside):
            self.finish(handle, "error", error="no instance can take new requests")

    def _place_beside(self, handle: RequestHandle, beside: Optional[Instance]) -> bool:
        """``place``, but on ``beside`` while it is an active instance that takes prompts."""
        takes_prompts = beside is not None and beside.state == "active" and (
            beside.role in ("prefill", "coupled") or isinstance(beside.scheduler, HybridScheduler))
        if not takes_prompts:
            return self.place(handle)
        if self.cfg.mode == "adaptive":
            self.placer.assign(handle, beside)
            return True
        handle.instance_id, handle.phase = beside.id, "prefill"
        if beside.role == "prefill":
            handle.prefill_instance = beside.id
        beside.submit(handle.request)
        return True

    def _release_siblings(self, first: RequestHandle, beside: Optional[Instance] = None) -> None:
        """``first`` has computed its prompt (on ``beside``) or ended: place its held siblings."""
        for handle in self.groups.release(first):
            self._enter(handle, beside)

    def _prediction_gate(self) -> str:
        """Where a request's predicted range must be on it: ``place`` before it enters a queue
        (sequential mode: the prediction adds to TTFT; coupled alise, whose ranking reads it at
        add), ``handoff`` before dispatch (disagg, parallel: it overlaps the prefill), or
        ``background`` (coupled vllm/sarathi read no prediction: it is only scored)."""
        if self.cfg.predictor_mode == "sequential" or (self.cfg.mode == "coupled" and self.engine.batching == "alise"):
            return "place"
        # adaptive: a prompt prefilled where it decodes has no hand-over to wait at
        return "handoff" if self.cfg.mode == "disagg" else "background"

    async def _place_when_predicted(self, handle: RequestHandle, beside: Optional[Instance] = None) -> None:
        await self.predictor.attach(handle.request)
        if handle.phase != "queued":  # aborted while its length was being predicted
            return
        if not self._place_beside(handle, beside):
            self.finish(handle, "error", error="no instance can take new requests")

    def place(self, handle: RequestHandle) -> bool:
        """Send a request with no KV anywhere to the least-loaded active entry instance (prefill
        or coupled). A request that already streamed tokens and has no coupled instance to go to
        is taken by a decode instance, which recomputes its prompt + output in one step."""
        req = handle.request
        if self.cfg.mode == "adaptive":
            return self.placer.place(handle)
        entry = [i for i in self.instances.values() if i.role in ("prefill", "coupled") and i.state == "active"]
        if entry and not (req.output_token_ids and entry[0].role == "prefill"):
            # the least work with this prompt there: a cached prefix counts (scheduling/placement.py)
            aware = self.cfg.prefix_aware_placement
            out = self.mean_output_tokens
            inst = min(entry, key=lambda i: (*entry_key(i.num_queued_tokens, req.num_tokens,
                                                        cached_prefix_tokens(i.blocks, req) if aware else 0,
                                                        i.kv_outlook(out, -i.blocks.num_blocks),
                                                        out if i.role == "coupled" else 0,
                                                        i.blocks.block_size), i.id))
            handle.instance_id, handle.phase = inst.id, "prefill"
            if inst.role == "prefill":
                handle.prefill_instance = inst.id
        else:
            decode = [i for i in self.instances.values() if i.role == "decode" and i.state == "active"]
            if not decode:
                return False
            inst = min(decode, key=lambda i: (i.num_requests, i.id))
            handle.instance_id, handle.decode_instance, handle.phase = inst.id, inst.id, "decode"
        inst.submit(req)
        return True

    def _check_capacity(self, req: Request) -> None:
        """Refuse, before the request enters the table, what no instance's KV pool could ever hold."""
        need = -(-(req.max_total_tokens() + 1) // self.engine.block_size)
        largest = max((i.blocks.num_blocks for i in self.instances.values()), default=0)
        if need > largest:
            raise ValueError(f"prompt plus max_tokens needs {need} KV blocks; the largest instance has {largest}")

    async def stream(self, handle: RequestHandle) -> AsyncIterator[TokenEvent]:
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
        self.handoff.request_changed()  # a hand-over waiting for room sees the flag
        if handle.phase == "transfer":
            return True  # the handoff task sees the flag and frees both sides
        inst = self.instances.get(handle.instance_id)
        if inst is not None:
            inst.abort(request_id)
        self.finish(handle, "abort")
        return True

    # ---- InstanceHost: what instances report -------------------------------------------------
    def on_step(self, instance: Instance, report: StepReport) -> None:
        if report.features:  # before the handoffs below, which wait for the ranges they give
            self.predictor.feed(report.features)
        for rid, got in (report.prompt_logprobs or {}).items():  # before the token that follows them
            handle = self.requests.get(rid)
            if handle is not None:
                handle.add_prompt_logprobs(got)
        logprobs = report.logprobs or {}
        for req, reason in report.tokens:
            if req.prefix_group is not None and req.num_output_tokens == 1:  # its prompt is in the KV here
                handle = self.requests.get(req.request_id)
                if handle is not None:
                    self._release_siblings(handle, instance)
            self._deliver(req, reason, logprobs.get(req.request_id))
        for req in report.prefilled:
            handle = self.requests.get(req.request_id)
            if handle is None or handle.phase == "done":
                continue
            moving = self.placer.moving.pop(req.request_id, None)
            if moving is not None and moving[1] == handle.epoch:  # a rebalance's move
                dst = self.instances.get(moving[0])
                if dst is None:  # removed since: it decodes here again
                    instance.keep_kv(req.request_id)
                    continue
                handle.phase = "transfer"
                self.placer.migrating.add(req.request_id)  # from now, not when the task first runs
                self.spawn(self._migrate(instance, handle, dst, moving[2]))
                continue
            if self.placer.keeps(instance, req):
                instance.keep_kv(req.request_id)
                handle.phase, handle.decode_instance = "decode", instance.id
                self.placer.placements["kept"] += 1
                continue
            handle.phase = "transfer"
            self.spawn(self._handoff(instance, handle))
        if self.cfg.mode == "adaptive":
            self.placer.observe(instance)
            self.placer.late_bind(instance)
            if self.cfg.kv_relief is not None:
                self.placer.relieve()
            if self.cfg.rebalance:
                self.placer.rebalance()

    def on_failure(self, instance: Instance, why: str) -> None:
        self.lifecycle.on_failure(instance, why)

    def _deliver(self, req: Request, reason: Optional[str], logprobs: Optional[TokenLogprobs] = None) -> None:
        """One new token of ``req`` to its consumer; ``reason``: the instance's stop check ended it."""
        handle = self.requests.get(req.request_id)
        if handle is None or handle.phase == "done":
            return
        now = self.clock.now()
        req.times.setdefault("first_token", now)
        handle.token_times.append(now)
        if handle.stream_tokens:
            handle.queue.put_nowait(TokenEvent(req.output_token_ids[-1], logprobs=logprobs))
        self.lifecycle.recovered(req.request_id)
        if reason:
            self.finish(handle, reason)

    async def _handoff(self, src: Instance, handle: RequestHandle) -> None:
        await self.predictor.attach(handle.request)  # parallel mode: the dispatcher and decode policies read it
        await self.handoff.run(src, handle)

    async def _migrate(self, src: Instance, handle: RequestHandle, dst: Instance, why: str) -> None:
        try:
            if await self.handoff.migrate(src, handle, dst):
                self.placer.landed(handle.request.request_id, src.id, dst.id, why)
        finally:
            self.placer.migrating.discard(handle.request.request_id)

    def finish(self, handle: RequestHandle, reason: str, error: Optional[str] = None) -> None:
        req = handle.request
        req.finish_reason, req.error = reason, error
        req.times["finish"] = self.clock.now()
        handle.phase = "done"
        self.predictor.finish(req)
        key = {"abort": "aborted", "error": "failed"}.get(reason, "finished")
        if key == "finished":
            self._outputs_seen = (self._outputs_seen[0] + 1, self._outputs_seen[1] + len(req.output_token_ids))
        if error:
            self.log.log("request_failed", handle.instance_id, f"{req.request_id}: {error}")
        self.counts[key] += 1
        handle.queue.put_nowait(TokenEvent(None, True, reason, error))
        self.requests.pop(req.request_id, None)
        self.lifecycle.recovered(req.request_id)
        if req.prefix_group is not None:  # ended before computing its prompt: its siblings go on alone
            self._release_siblings(handle)

    # ---- views -------------------------------------------------------------------------------
    @property
    def mean_output_tokens(self) -> int:
        """Output tokens of the requests finished so far, on average (0 before the first): the
        growth placement expects of a request's KV, from what has been served, never from the
        request's own length."""
        n, total = self._outputs_seen
        return total // n if n else 0

    def all_counts(self) -> dict:
        """Requests ended by outcome, and the lifecycle's and hand-over's counters."""
        return {**self.counts, **self.lifecycle.counts, **self.handoff.counts}

    def free_blocks(self) -> dict[str, int]:
        return {iid: inst.blocks.num_free for iid, inst in self.instances.items()}

    def total_blocks(self) -> dict[str, int]:
        return {iid: inst.blocks.num_blocks for iid, inst in self.instances.items()}
