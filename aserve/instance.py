"""One instance: a device, its KV pool, its single-thread executor and its role's scheduler.

The worker coroutine runs on the event loop; the forward runs on the instance's own executor
(never on the loop thread), so instances compute in parallel and the loop stays responsive.
Only the loop thread touches schedulers, blocks and requests (the thread rule): the executor
gets an immutable ``StepInput`` and returns a ``StepOutput``.

    role prefill : PrefillScheduler --ChunkPlan--> runner --> commit --> cluster.on_prefill_done
    role decode  : DecodeScheduler  --schedule---> runner --> update --> cluster.on_token
    role coupled : CoupledScheduler --schedule---> runner --> update --> cluster.on_token
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

import torch

from aserve.config import ClusterConfig, EngineConfig
from aserve.engine import ModelBundle, add_swap_space, build_coupled_scheduler, build_runner, step_input
from aserve.runner import SeqWork, StepInput, StepOutput
from model.sampler import SampleSpec
from scheduling import registry
from scheduling.decode import DecodeConfig
from scheduling.dispatch import DispatchConfig
from scheduling.prefill import ChunkPlan, PrefillConfig
from scheduling.request import Request

if TYPE_CHECKING:
    from aserve.cluster import Cluster


def _init_thread(num_threads: int, device: str) -> None:
    if device == "cpu":
        torch.set_num_threads(num_threads)  # inside the executor's own thread: its share of the cores
    else:
        torch.cuda.set_device(torch.device(device))


def spec_for(req: Request) -> SampleSpec:
    sp = req.sampling
    return SampleSpec(sp.temperature, sp.top_k, sp.top_p, sp.seed, req.num_output_tokens)


class Instance:
    """``role`` is prefill, decode or coupled; ``state`` is active, draining or failed."""

    def __init__(self, instance_id: str, role: str, bundle: ModelBundle, engine: EngineConfig, cfg: ClusterConfig,
                 cluster: "Cluster", device: str, num_threads: int):
        self.id, self.role, self.device, self.num_threads = instance_id, role, device, num_threads
        self.cluster, self.cfg, self.state = cluster, cfg, "active"
        self.runner, self.blocks = build_runner(bundle, engine)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"aserve-{instance_id}",
                                           initializer=_init_thread, initargs=(num_threads, device))
        self.bundle, self.engine = bundle, engine
        self.prefill = self.decode = self.coupled = self.dispatcher = None
        self._make_role(role)
        self.wake = asyncio.Event()
        self.task: Optional[asyncio.Task] = None
        # counters for metrics and the paper's resource-usage time
        self.busy_s = 0.0  # wall seconds with a step running (or the emulated device's, if slower)
        self.cpu_s = 0.0  # CPU seconds of the executor thread in steps
        self.busy_by_role = {"prefill": 0.0, "decode": 0.0, "coupled": 0.0}
        self.num_flips = 0
        self.num_transfers_in = self.num_transfers_out = 0  # handoffs moving KV into / out of here
        self.failure: Optional[str] = None
        self._fault: Optional[str] = None  # injected by tests and chaos drills: raise at the next step
        self.num_steps = self.num_prefill_tokens = self.num_decode_tokens = self.num_pad_tokens = 0
        self.num_preemptions = 0

    def _make_role(self, role: str) -> None:
        """Build the role's scheduler over the instance's own pool: no model reload, no new pool."""
        cfg, clock, bundle, engine = self.cfg, self.cluster.clock, self.bundle, self.engine
        self.prefill = self.decode = self.coupled = self.dispatcher = None
        if role == "prefill":
            self.prefill = registry.get("prefill", cfg.prefill_policy)(
                self.blocks, PrefillConfig(cfg.chunk_size, cfg.prefill_sched_batch, cfg.pad), clock)
            self.dispatcher = registry.get("dispatch", cfg.dispatch)(DispatchConfig(cfg.heavy_threshold, cfg.seed))
        elif role == "decode":
            swap_blocks = 0
            if cfg.preemption == "swap":
                host = self.runner.host_kv
                swap_blocks = host.num_blocks if host is not None else \
                    add_swap_space(self.runner, bundle, engine).num_blocks
            self.decode = registry.get("decode", cfg.decode_policy)(
                self.blocks, DecodeConfig(max_running=engine.max_num_seqs, preemption=cfg.preemption,
                                          num_swap_blocks=swap_blocks, heavy_threshold=cfg.heavy_threshold), clock)
        else:
            self.coupled = build_coupled_scheduler(self.runner, self.blocks, bundle, engine, clock)
        self.role = role

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        loop = {"prefill": self._prefill_loop, "decode": self._decode_loop, "coupled": self._coupled_loop}[self.role]
        self.task = asyncio.create_task(self._guarded(loop()), name=f"instance-{self.id}")

    async def _guarded(self, loop) -> None:
        """Run the role's loop; a step that raises (or any bug in the loop) fails the instance,
        and the control plane moves its requests elsewhere instead of losing them."""
        try:
            await loop
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - every failure must reach the control plane
            self.cluster.on_instance_failed(self, f"{type(e).__name__}: {e}")

    async def _halt(self) -> None:
        """Stop the worker coroutine (a step already on the executor runs to its end unseen)."""
        if self.task and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass

    async def stop(self) -> None:
        await self._halt()
        self.executor.shutdown(wait=True)

    async def switch_role(self, role: str) -> None:
        """The flip itself, once drained: halt the idle worker, swap the scheduler, start again."""
        assert self.holds() == 0, f"instance {self.id} still holds requests"
        await self._halt()
        self._make_role(role)
        self.num_flips += 1
        self.start()

    def inject_fault(self) -> None:
        """Make the next step raise, as a device error would (fault-injection drills and tests)."""
        self._fault = "injected fault"

    def notify(self) -> None:
        self.wake.set()

    async def _idle(self) -> None:
        self.wake.clear()
        await self.wake.wait()

    async def _run(self, step: StepInput) -> StepOutput:
        if self._fault:
            fault, self._fault = self._fault, None
            raise RuntimeError(fault)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        out, cpu_s = await loop.run_in_executor(self.executor, self._timed_execute, step)
        dt = time.perf_counter() - t0
        self.cpu_s += cpu_s
        device_s = cpu_s * self.cluster.device_slowdown()
        if device_s > dt:  # an emulated dedicated device is slower than the core we borrowed
            await asyncio.sleep(device_s - dt)
            dt = device_s
        self.busy_s += dt
        self.busy_by_role[self.role] += dt
        self.num_steps += 1
        return out

    def _timed_execute(self, step: StepInput) -> tuple[StepOutput, float]:
        """The step, and the CPU seconds this (executor) thread spent on it."""
        c0 = time.thread_time()
        out = self.runner.execute(step)
        return out, time.thread_time() - c0

    # ---- prefill ---------------------------------------------------------------------------
    async def _prefill_loop(self) -> None:
        while True:
            plan = self.prefill.plan_chunk()
            if plan is None:
                await self._idle()
                continue
            out = await self._run(self._chunk_step(plan))
            if out.features:  # before the handoff, which waits for the range they give
                self.cluster.predictor.feed(out.features)
            self.num_prefill_tokens += plan.num_real_tokens
            self.num_pad_tokens += plan.num_pad_tokens
            now = self.cluster.clock.now()
            for s in plan.slices:  # per-request chunk timestamps: (end time, tokens of this request)
                req = self.prefill._requests.get(s.request_id)
                if req is not None:
                    req.times.setdefault("chunks", []).append((now, s.num_tokens))
            for req in self.prefill.commit(plan, out.sampled):
                self.cluster.on_prefill_done(self, req)

    def _chunk_step(self, plan: ChunkPlan) -> StepInput:
        seqs, tap_layer = [], 0
        finishing = set(plan.finishing_ids)
        for s in plan.slices:
            req = self.prefill._requests[s.request_id]
            req.times.setdefault("scheduled", self.cluster.clock.now())
            last = s.request_id in finishing
            tap = last and req.feature_layer > 0  # the length predictor reads the prompt's last token
            tap_layer = max(tap_layer, req.feature_layer if tap else 0)
            seqs.append(SeqWork(s.request_id, tuple(req.prompt_token_ids[s.start:s.end]), s.start,
                                plan.block_ids[s.request_id], spec_for(req) if last else None, tap))
        return StepInput(tuple(seqs), num_pad_tokens=plan.num_pad_tokens, tap_layer=tap_layer)

    # ---- decode ----------------------------------------------------------------------------
    async def _decode_loop(self) -> None:
        while True:
            sched = self.decode.schedule()
            if not sched.num_scheduled_tokens:
                if sched.swap_out or sched.swap_in:
                    await self._run(StepInput((), swap_out=sched.swap_out, swap_in=sched.swap_in))
                await self._idle()
                continue
            self.num_preemptions += len(sched.preempted_ids)
            seqs = []
            for rid, n in sched.num_scheduled_tokens.items():
                req = self.decode._requests[rid]
                start = sched.num_computed_tokens[rid]
                seqs.append(SeqWork(rid, tuple(req.token_ids_slice(start, start + n)), start, sched.block_ids[rid],
                                    spec_for(req)))
            out = await self._run(StepInput(tuple(seqs), swap_out=sched.swap_out, swap_in=sched.swap_in))
            self.num_decode_tokens += len(out.sampled)
            finished = [rid for rid, tok in out.sampled.items() if self.cluster.would_stop(rid, tok)]
            self.decode.update(sched, out.sampled, finished)
            for rid in out.sampled:
                self.cluster.on_token(self, rid, finished=rid in finished)

    # ---- coupled ---------------------------------------------------------------------------
    async def _coupled_loop(self) -> None:
        sched = self.coupled
        while True:
            if not sched.has_work:
                await self._idle()
                continue
            out = sched.schedule()
            if out.empty and not getattr(out, "swap_in", ()):
                await self._idle()
                continue
            self.num_preemptions += len(out.preempted_ids)
            now = self.cluster.clock.now()
            for rid in out.num_scheduled:
                sched.requests[rid].times.setdefault("scheduled", now)
            res = await self._run(step_input(out, sched.requests))
            self.num_decode_tokens += len(res.sampled)
            self.num_prefill_tokens += out.total_tokens - len(res.sampled)
            for req in sched.update(out, res.sampled):
                reason = self.cluster.stop_reason(req)
                self.cluster.on_token(self, req.request_id, finished=reason is not None)
                if reason:
                    sched.finish(req, reason)

    # ---- views -----------------------------------------------------------------------------
    def queued_tokens(self) -> int:
        """Load for the global scheduler: prompt tokens waiting on this instance."""
        if self.prefill is not None:
            return self.prefill.num_queued_tokens
        if self.coupled is not None:
            return sum(r.num_uncomputed_tokens for r in self.coupled.waiting) + 4 * len(self.coupled.running)
        return 0

    def holds(self) -> int:
        if self.prefill is not None:
            return len(self.prefill._requests)
        if self.decode is not None:
            return len(self.decode._requests)
        return len(self.coupled.requests)
