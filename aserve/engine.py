"""Model loading shared by every instance, and ``LLM``: the offline batch API.

``LLM.generate`` runs the coupled scheduler and the runner in the caller's thread until every
prompt is done; tests, tools (labelling, benchmarks) and ``aserve generate`` use it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from aserve.config import EngineConfig
from aserve.output import StopChecker
from aserve.runner import ModelRunner, SeqWork, StepInput
from model.attention import pick_backend
from model.config import ModelArgs
from model.kv_cache import KVCache, host_swap_space, num_blocks_for_budget
from model.loader import chat_token_ids, load_model, pick_dtype, read_config, resolve_model
from model.sampler import SampleSpec
from scheduling.block_manager import BlockManager
from scheduling.clock import Clock
from scheduling.alise import build_coupled
from scheduling.coupled import CoupledScheduler, SchedulerOutput
from scheduling.request import Request, SamplingParams

Prompt = Union[str, Sequence[int], list]  # text, token ids, or chat messages [{"role", "content"}]


class PromptTooLong(ValueError):
    """Prompt plus max_tokens does not fit the model's context window."""


@dataclass
class ModelBundle:
    """A loaded model with its tokenizer; CPU instances share one bundle (same memory)."""

    path: Path
    args: ModelArgs
    model: torch.nn.Module
    tokenizer: object
    dtype: torch.dtype
    device: str

    @staticmethod
    def load(cfg: EngineConfig, model: Optional[torch.nn.Module] = None) -> "ModelBundle":
        from transformers import AutoTokenizer

        path = resolve_model(cfg.model, Path(cfg.cache_dir) if cfg.cache_dir else None)
        hf_cfg = read_config(path)
        args = ModelArgs.from_hf(hf_cfg)
        dtype = pick_dtype(cfg.dtype, cfg.device)
        model = model or load_model(path, dtype, cfg.device, pick_backend(cfg.attention, cfg.device))
        tokenizer = AutoTokenizer.from_pretrained(path)
        return ModelBundle(path, args, model, tokenizer, dtype, cfg.device)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.args.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of a prompt; ``chat`` wraps a string as one user message."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        if isinstance(prompt, (list, tuple)):  # chat messages
            return chat_token_ids(self.tokenizer, list(prompt))
        if chat:
            return self.encode([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        limit = self.args.max_position
        if num_prompt_tokens + max_tokens > limit:
            raise PromptTooLong(f"prompt of {num_prompt_tokens} tokens plus max_tokens {max_tokens} exceeds "
                                f"the model's context window of {limit} tokens")


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


def build_runner(bundle: ModelBundle, cfg: EngineConfig) -> tuple[ModelRunner, BlockManager]:
    """A KV pool sized by ``kv_cache_gb``, its block manager, and a runner over both."""
    num_blocks = num_blocks_for_budget(bundle.args, cfg.block_size, bundle.dtype, int(cfg.kv_cache_gb * 2**30))
    kv = KVCache(bundle.args, num_blocks, cfg.block_size, bundle.dtype, cfg.device)
    return ModelRunner(bundle.model, kv, cfg.device, cfg.seed), BlockManager(num_blocks, cfg.block_size)


def add_swap_space(runner: ModelRunner, bundle: ModelBundle, cfg: EngineConfig) -> BlockManager:
    """Host memory for swapped-out KV blocks (``swap_gb``), attached to the runner. With
    ``swap_dtype="int8"`` a block takes INT8 bytes plus scales, so the same budget holds more."""
    runner.host_kv = host_swap_space(bundle.args, cfg.block_size, bundle.dtype, max(1, int(cfg.swap_gb * 2**30)),
                                     cfg.swap_dtype)
    return BlockManager(runner.host_kv.num_blocks, cfg.block_size)


def build_coupled_scheduler(runner: ModelRunner, blocks: BlockManager, bundle: ModelBundle, cfg: EngineConfig,
                            clock=None) -> CoupledScheduler:
    """The coupled batching policy of ``cfg``; ALISE also gets host swap space and the clock."""
    if cfg.batching != "alise":
        return build_coupled(blocks, cfg.batching, cfg.max_num_batched_tokens, cfg.max_num_seqs)
    host = add_swap_space(runner, bundle, cfg) if runner.host_kv is None else \
        BlockManager(runner.host_kv.num_blocks, cfg.block_size)
    return build_coupled(blocks, "alise", cfg.max_num_batched_tokens, cfg.max_num_seqs, clock=clock, host_blocks=host)


def step_input(sched_out: SchedulerOutput, requests: dict[str, Request], want_logits: bool = False) -> StepInput:
    """Turn a scheduler decision into the runner's immutable input."""
    seqs = []
    for rid, n in sched_out.num_scheduled.items():
        req = requests[rid]
        start = req.num_computed_tokens
        done = start + n == req.num_tokens
        spec = SampleSpec(req.sampling.temperature, req.sampling.top_k, req.sampling.top_p, req.sampling.seed,
                          req.num_output_tokens) if done else None
        seqs.append(SeqWork(rid, tuple(req.token_ids_slice(start, start + n)), start, tuple(req.block_ids), spec))
    return StepInput(tuple(seqs), want_logits=want_logits, swap_out=tuple(getattr(sched_out, "swap_out", ())),
                     swap_in=tuple(getattr(sched_out, "swap_in", ())))


class LLM:
    """Offline batch generation: ``LLM(EngineConfig(...)).generate(prompts, params)``."""

    def __init__(self, cfg: EngineConfig = EngineConfig(), bundle: Optional[ModelBundle] = None,
                 clock: Optional[Clock] = None):
        if cfg.device == "cpu" and cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.clock = clock  # ALISE's clock (aging, waits); None: the monotonic clock
        self.bundle = bundle or ModelBundle.load(cfg)
        self.runner, self.blocks = build_runner(self.bundle, cfg)
        self.stops = StopChecker(self.bundle.tokenizer, self.bundle.eos_token_ids)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.bundle.tokenizer

    def generate(self, prompts: Sequence[Prompt], params: Union[SamplingParams, Sequence[SamplingParams]] = SamplingParams(),
                 chat: bool = False, progress=None) -> list[Completion]:
        """Generate for every prompt; results in prompt order. ``progress(n_done, n_tokens)`` is called per step."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        sched = build_coupled_scheduler(self.runner, self.blocks, self.bundle, self.cfg, self.clock)
        reqs = []
        for prompt, sp in zip(prompts, plist):
            ids = self.bundle.encode(prompt, chat)
            self.bundle.check_fits(len(ids), sp.max_tokens)
            reqs.append(Request(f"offline-{next(self._ids)}", ids, sp))
        for r in reqs:
            sched.add(r)
        table = {r.request_id: r for r in reqs}
        done = 0
        try:
            while sched.has_work:
                out = sched.schedule()
                assert not out.empty or getattr(out, "swap_in", ()), "scheduler made no progress"
                res = self.runner.execute(step_input(out, table))
                for req in sched.update(out, res.sampled):
                    reason = self.stops.check(req)
                    if reason:
                        sched.finish(req, reason)
                        done += 1
                if progress:
                    progress(done, res.num_tokens)
        finally:
            for r in list(sched.requests.values()):
                sched.finish(r, "abort")
        return [Completion(r.request_id, r.prompt_token_ids, r.output_token_ids, self.stops.text(r), r.finish_reason)
                for r in reqs]
