"""The torch device: the model over a paged KV pool, on the device's own executor thread.

    event loop ──plan──► executor thread (its share of the CPU's torch threads, or a CUDA device)
                             ModelRunner.execute(plan) ──► StepOutput, CPU seconds
               ◄─────────── busy time: the step's wall time, or an emulated dedicated device's
                            (CPU seconds x CoreShare.slowdown), waited out on the loop

KV hand-overs copy on a second thread of the device (its copy engine), so neither the event
loop nor a running step waits for them. Several devices of one process share one
``ModelBundle`` (same weights); each has its own pool.

``inline=True`` (the offline ``LLM``, whose loop serves nobody else) steps on the loop's own
thread instead: the thread that loaded the model already has the process's OpenMP team, and a
second thread's team makes libgomp count more threads than cores and stop spin-waiting, which
measured 7-12% slower per step on this 2-core machine (a batch-32 decode step: 56 ms on the
loading thread, 60-65 ms on another).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import torch

from aserve.config import EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.devices.cuda_graphs import DecodeGraphs
from aserve.devices.device import CoreShare, Device
from aserve.devices.runner import ModelRunner
from model.config import ModelArgs
from model.kv_cache import KVCache, host_swap_space, num_blocks_for_budget, num_swap_blocks
from scheduling.block_manager import BlockManager
from scheduling.step import GREEDY, SeqStep, StepOutput, StepPlan


def _init_thread(num_threads: int, device: str) -> None:
    if device == "cpu":
        torch.set_num_threads(num_threads)  # inside the executor's own thread: its share of the cores
    else:
        # a stream of its own: instances sharing one card overlap their steps and copies instead of
        # queueing on the default stream (a step waits for its own stream only: runner.execute)
        dev = torch.device(device)
        if dev.index is None:  # "cuda": the current device (set_device takes no unindexed device)
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        torch.cuda.set_stream(torch.cuda.Stream(dev))


def pool_num_blocks(args: ModelArgs, dtype: torch.dtype, cfg: EngineConfig) -> int:
    """KV blocks of one device's pool (``cfg.kv_cache_gb``): a device in another process is sized
    by the same rule, so the driver knows its capacity before the process is up."""
    return num_blocks_for_budget(args, cfg.block_size, dtype, int(cfg.kv_cache_gb * 2**30))


def swap_num_blocks(args: ModelArgs, dtype: torch.dtype, cfg: EngineConfig) -> int:
    """Host swap blocks of one device (``cfg.swap_gb`` in ``cfg.swap_dtype``), by the same rule."""
    return num_swap_blocks(args, cfg.block_size, dtype, max(1, int(cfg.swap_gb * 2**30)), cfg.swap_dtype)


def uses_cuda_graphs(cfg: EngineConfig) -> bool:
    """Decode steps replay CUDA graphs on a CUDA device unless ``enforce_eager``."""
    return cfg.device.startswith("cuda") and not cfg.enforce_eager


def build_runner(bundle: ModelBundle, cfg: EngineConfig) -> tuple[ModelRunner, BlockManager]:
    """A KV pool sized by ``cfg.kv_cache_gb``, a runner over it and a block manager of its blocks
    (benchmarks step the runner directly). On CUDA the decode steps' graphs are captured here,
    before the device serves anything (``runner.graphs.report`` says what that cost)."""
    num_blocks = pool_num_blocks(bundle.args, bundle.dtype, cfg)
    graphs = uses_cuda_graphs(cfg)
    kv = KVCache(bundle.args, num_blocks, cfg.block_size, bundle.dtype, cfg.device, scratch=graphs)
    runner = ModelRunner(bundle.model, kv, cfg.device, cfg.seed)
    if graphs:
        runner.graphs = DecodeGraphs(bundle.model, kv, cfg.max_num_seqs, bundle.args.max_position,
                                     fused=cfg.fused_step)
        runner.graphs.capture()
    return runner, BlockManager(num_blocks, cfg.block_size)


class TorchDevice(Device):
    """A KV pool sized by ``cfg.kv_cache_gb`` and a runner over it, stepped on its own thread."""

    def __init__(self, name: str, bundle: ModelBundle, cfg: EngineConfig, num_threads: int,
                 share: Optional[CoreShare] = None, inline: bool = False):
        super().__init__()
        self.name, self.cfg, self.bundle = name, cfg, bundle
        self.runner, _ = build_runner(bundle, cfg)  # the instance keeps its own block manager
        self.kv = self.runner.kv
        self.block_size, self.num_blocks = cfg.block_size, self.kv.num_blocks
        self.share = share or CoreShare()
        self.num_threads = num_threads
        self.executor = None if inline else ThreadPoolExecutor(1, thread_name_prefix=f"aserve-{name}",
                                                               initializer=_init_thread,
                                                               initargs=(num_threads, cfg.device))
        self._copier: Optional[ThreadPoolExecutor] = None  # the copy thread, made at the first send
        self.lender = self.share.lender if cfg.device == "cpu" and not inline else None
        if self.lender is not None:
            self.lender.join(name, num_threads)

    @property
    def kind(self) -> str:
        return self.cfg.device

    def describe(self) -> str:
        """Where the device runs and what it holds, for the start-up lines: its KV pool (its
        share of the card where several instances share one GPU) and its CUDA graphs."""
        gib = self.kv.pool.numel() * self.kv.pool.element_size() / 2**30
        text = f"{self.name}: {self.cfg.device}, KV pool {gib:.2f} GiB ({self.num_blocks} blocks of {self.block_size})"
        if self.runner.graphs is not None and self.runner.graphs.report is not None:
            text += "; " + self.runner.graphs.report.describe()
        return text

    async def _execute(self, plan: StepPlan) -> StepOutput:
        if self.lender is None:
            return await self._execute_on(plan, None)
        threads = await self.lender.take(self.name, plan.num_real_tokens)
        try:
            return await self._execute_on(plan, threads)
        finally:
            self.lender.give(self.name)

    def set_idle(self, idle: bool) -> None:
        if self.lender is not None:
            self.lender.set_idle(self.name, idle)

    async def _execute_on(self, plan: StepPlan, threads: Optional[int]) -> StepOutput:
        """The step on the executor thread, at ``threads`` torch threads (None: as it is)."""
        t0 = time.perf_counter()
        if self.executor is None:
            out, cpu_s = self._timed_execute(plan)
        else:
            out, cpu_s = await asyncio.get_running_loop().run_in_executor(self.executor, self._timed_execute, plan,
                                                                          threads)
        busy_s = time.perf_counter() - t0
        self.cpu_s += cpu_s
        device_s = cpu_s * self.share.slowdown() if self.cfg.device == "cpu" else 0.0
        if device_s > busy_s:  # an emulated dedicated device is slower than the core we borrowed
            await asyncio.sleep(device_s - busy_s)
            busy_s = device_s
        return dataclasses.replace(out, busy_s=busy_s)

    async def warm_up(self, block_ids: Sequence[int]) -> None:
        """A prompt chunk, then a decode step over it, on the device's own thread (the same shapes
        of work a first request brings): the first request after start is then as fast as the
        tenth (a lone first request took 1,040 ms against 162-175 ms for the next seven, issue 60).
        Where cores are lent, the chunk once more on all of them (the first lent step's set-up: its
        OpenMP team, the product choice of ``model.native.wide_rows`` at that thread count), and,
        at the first device's warm-up, the decode step timed at its own threads and on every core
        (``CoreLender.learn``: whether a lone decode row borrows an idle instance's core)."""
        n = min(32, len(block_ids) * self.block_size - 1)
        ids = tuple(range(100, 100 + n))
        first = StepPlan((SeqStep("warm-up", ids, 0, tuple(block_ids), GREEDY),))
        second = StepPlan((SeqStep("warm-up", (7,), n, tuple(block_ids), GREEDY, 1),))
        for plan in (first, second):
            await self._execute(plan)
        if self.lender is not None and self.lender.cores > self.num_threads:  # and a lent prompt chunk's
            await self.lender.take_all(self.name)
            try:
                await self._execute_on(first, self.lender.cores)
                if self.lender.measured is None:  # the first warm-up: is a lone row faster lent?
                    self.lender.learn(await self._fastest(second, self.num_threads),
                                      await self._fastest(second, self.lender.cores))
            finally:
                self.lender.give(self.name)

    async def _fastest(self, plan: StepPlan, threads: int, tries: int = 3) -> float:
        """The fastest of ``tries`` runs of ``plan`` at ``threads`` threads, wall seconds."""
        best = float("inf")
        for _ in range(tries):
            t0 = time.perf_counter()
            await self._execute_on(plan, threads)
            best = min(best, time.perf_counter() - t0)
        return best

    def execute_blocking(self, plan: StepPlan) -> StepOutput:
        """The step from a thread of its own (a Ray actor's step channel), waiting for it: on the
        device's step thread as ``execute`` runs it, without the event loop. No dedicated-device
        emulation (``CoreShare``): a device in its own process shares nothing to emulate."""
        t0 = time.perf_counter()
        out, cpu_s = self._timed_execute(plan) if self.executor is None else \
            self.executor.submit(self._timed_execute, plan).result()
        self.cpu_s += cpu_s
        return dataclasses.replace(out, busy_s=time.perf_counter() - t0)

    def _timed_execute(self, plan: StepPlan, threads: Optional[int] = None) -> tuple[StepOutput, float]:
        """The step (at ``threads`` torch threads, if given), and the CPU seconds this (executor)
        thread spent on it (not its OpenMP workers')."""
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)  # this thread's OpenMP team only
        c0 = time.thread_time()
        out = self.runner.execute(plan)
        return out, time.thread_time() - c0

    def add_swap_space(self) -> int:
        """Host memory for swapped-out KV blocks (``swap_gb``), attached to the runner once. With
        ``swap_dtype="int8"`` a block takes INT8 bytes plus scales, so the same budget holds more."""
        if self.runner.host_kv is None:
            self.runner.host_kv = host_swap_space(self.bundle.args, self.block_size, self.bundle.dtype,
                                                  max(1, int(self.cfg.swap_gb * 2**30)), self.cfg.swap_dtype)
        return self.runner.host_kv.num_blocks

    async def send_kv(self, request_id: str, block_ids: Sequence[int], dst: Device, dst_block_ids: Sequence[int],
                      link, num_tokens: int):
        """The real block copy into ``dst``'s pool on this device's copy thread; ``link`` (a
        ``netemu.KVLink``) waits out the emulated link time on top of it."""
        if not isinstance(dst, TorchDevice):
            raise TypeError(f"a torch device sends KV to a torch device, not {type(dst).__name__}")
        return await link.write(request_id, self.kv.pool, list(block_ids), dst.kv.pool, list(dst_block_ids),
                                num_tokens=num_tokens, executor=self.copier())

    def copier(self) -> ThreadPoolExecutor:
        """The device's copy thread (its copy engine), made at the first hand-over."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix=f"aserve-{self.name}-kv",
                                              initializer=_init_thread, initargs=(1, self.cfg.device))
        return self._copier

    async def close(self) -> None:
        """Wait for the step and copy in flight (off the loop), stop the device's threads, and let
        the KV pool go now (a removed instance's memory comes back at once, whoever refers to it)."""
        for pool in (self._copier, self.executor):
            if pool is not None:
                await asyncio.to_thread(pool.shutdown, True)
        if self.lender is not None:
            self.lender.leave(self.name)
        self.runner = self.kv = None
