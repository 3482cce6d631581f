"""``LLM``: the offline batch API. ``LLM(EngineConfig(...)).generate(prompts, params)``.

It runs one coupled ``Instance`` (the same step loop as the server's instances, on the same
kind of device) under its own event loop until every prompt is done; tests, tools (labelling,
benchmarks) and ``aserve generate`` use it. Call it from synchronous code (it starts a loop).
Its device steps on the calling thread (``TorchDevice(inline=True)``: the loop serves nobody
else, and that thread already owns the process's OpenMP team; aserve/devices/torch_device.py).
"""
from __future__ import annotations

import asyncio
import itertools
import os

import torch
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from aserve.config import EngineConfig
from aserve.engine.bundle import ModelBundle, Prompt
from aserve.engine.instance import Instance, StepReport
from aserve.engine.policies import Policies
from aserve.engine.stops import StopChecker
from aserve.devices.measured import step_room
from aserve.devices.torch_device import TorchDevice
from aserve.event_loop import run as run_loop
from scheduling.clock import Clock, MonotonicClock
from scheduling.request import Request, SamplingParams


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class LLM:
    """Offline batch generation over one device; ``generate`` may be called many times."""

    def __init__(self, cfg: EngineConfig = EngineConfig(), bundle: Optional[ModelBundle] = None,
                 clock: Optional[Clock] = None):
        self.cfg = cfg
        self.clock = clock or MonotonicClock()  # ALISE's clock (aging, waits)
        self.bundle = bundle or ModelBundle.load(cfg)
        if cfg.device == "cpu" and cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)  # the calling thread steps the model (inline)
        self.device = TorchDevice("offline", self.bundle, cfg, cfg.num_threads or os.cpu_count() or 1, inline=True)
        self.stops = StopChecker(self.bundle.tokenizer, self.bundle.eos_token_ids)
        policies = Policies.from_configs(cfg, step_room=step_room(cfg))
        self.instance = Instance("offline", "coupled", self.device, policies, self.stops, self.clock, self)
        self.blocks = self.instance.blocks
        self._ids = itertools.count()
        self._num_requests = self._num_done = 0  # of the running ``generate``
        self._progress: Optional[Callable[[int, int], None]] = None
        self._over: Optional[asyncio.Future] = None

    @property
    def tokenizer(self):
        return self.bundle.tokenizer

    def generate(self, prompts: Sequence[Prompt], params: Union[SamplingParams, Sequence[SamplingParams]] = SamplingParams(),
                 chat: bool = False, progress: Optional[Callable[[int, int], None]] = None) -> list[Completion]:
        """Generate for every prompt; results in prompt order. ``progress(n_done, n_tokens)`` is
        called after every step with the requests done so far and the step's token count."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = []
        for prompt, sp in zip(prompts, plist):
            ids = self.bundle.encode(prompt, chat)
            self.bundle.check_fits(len(ids), sp.max_tokens)
            reqs.append(Request(f"offline-{next(self._ids)}", ids, sp))
        run_loop(self._run(reqs, progress))
        return [Completion(r.request_id, r.prompt_token_ids, r.output_token_ids, self.stops.text(r), r.finish_reason)
                for r in reqs]

    async def _run(self, reqs: list[Request], progress) -> None:
        inst, self._progress = self.instance, progress
        self._num_requests, self._num_done = len(reqs), 0
        self._over = asyncio.get_running_loop().create_future()
        try:
            for r in reqs:
                inst.submit(r)
            inst.start()
            if reqs:
                await self._over
        finally:
            await inst.halt()
            for r in reqs:
                if not r.finished:
                    inst.abort(r.request_id)

    # ---- the instance's host --------------------------------------------------------------------
    def on_step(self, instance: Instance, report: StepReport) -> None:
        self._num_done += sum(reason is not None for _, reason in report.tokens)
        if self._progress:
            self._progress(self._num_done, report.num_tokens)
        if self._num_done == self._num_requests and not self._over.done():
            self._over.set_result(None)

    def on_failure(self, instance: Instance, why: str) -> None:
        if not self._over.done():
            self._over.set_exception(RuntimeError(f"the engine failed: {why}"))
