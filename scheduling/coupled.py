"""Coupled batching: one instance does prefill and decode, vLLM-v1 style.

``schedule()`` decides how far each request's ``num_computed_tokens`` moves this step (a prompt
chunk, a recompute, or 1 for a decode) and returns it as a ``StepPlan``; ``update()`` applies
the sampled tokens. Policies differ only in ordering and budget:

- ``sarathi`` (stall-free, Sarathi-Serve Alg. 3): all running decodes first, then the partly
  done prefills' next chunks, then new requests, within ``max_num_batched_tokens``.
- ``vllm`` (prefill-first, Sarathi-Serve Alg. 2): when new requests fit, a prefill-only
  iteration of whole prompts; otherwise a decode-only iteration. Never mixes the two.
- ``alise`` (scheduling/alise.py): speculative, preemptive, from predicted lengths.

Preemption (sarathi, vllm) is by recompute: the newest running request gives its blocks back
and goes to the front of the waiting queue with ``num_computed_tokens = 0``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Optional

from scheduling.base import Scheduler
from scheduling.block_manager import BlockManager, blocks_needed
from scheduling.clock import Clock
from scheduling.request import Request, Status
from scheduling.step import EMPTY_PLAN, StepEvents, StepOutput, StepPlan, seq_step


@dataclass(frozen=True)
class BatchingConfig:
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 256  # requests in one batch at most

    def __post_init__(self):
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens and max_num_seqs must be >= 1, got {self}")


class CoupledScheduler(Scheduler):
    """The queues and bookkeeping every coupled policy shares; each policy is its ``schedule``."""

    role = "coupled"
    uses_swap: ClassVar[bool] = False  # True: needs host blocks (``host_blocks``) for swapped KV

    def __init__(self, blocks: BlockManager, config: BatchingConfig = BatchingConfig(),
                 clock: Optional[Clock] = None):
        super().__init__(blocks, clock)
        self.config = config
        self.max_num_batched_tokens, self.max_num_seqs = config.max_num_batched_tokens, config.max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if blocks_needed(req.num_tokens + 1, self.blocks.block_size) > self.blocks.num_blocks:
            raise ValueError(f"request {req.request_id} needs more KV blocks than the instance has")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """End a request (stop, length, abort, error) and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.status, req.finish_reason = Status.FINISHED, reason
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Optional[Request]:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def queue_lengths(self) -> tuple[int, int]:
        return len(self.waiting), len(self.running)

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens waiting, plus a little for each running request (it still decodes)."""
        return sum(r.num_uncomputed_tokens for r in self.waiting) + 4 * len(self.running)

    # ---- one step -----------------------------------------------------------------------
    def _to_plan(self, plan: dict[str, int], preempted: list[str], **extra) -> StepPlan:
        """A policy's decision ``{request_id: num_tokens}`` as the step's ``StepPlan``."""
        assert sum(plan.values()) <= self.max_num_batched_tokens or len(plan) == 1
        if not plan and not preempted and not any(extra.values()):
            return EMPTY_PLAN
        return StepPlan(self._seqs(plan), preempted_ids=tuple(preempted), **extra)

    def _seqs(self, plan: dict[str, int]) -> tuple:
        """The plan's rows: each request's next ``n`` tokens; a token is sampled where they
        reach its end. The first time a request is scheduled is its ``scheduled`` time."""
        now, seqs = self.clock.now(), []
        for rid, n in plan.items():
            req = self.requests[rid]
            req.times.setdefault("scheduled", now)
            start = req.num_computed_tokens
            seqs.append(seq_step(req, start, start + n, sample=start + n == req.num_tokens))
        return tuple(seqs)

    def _grow(self, req: Request, n: int, preempted: list[str]) -> bool:
        """Make ``req``'s blocks cover ``num_computed + n`` tokens, preempting the newest others."""
        need = blocks_needed(req.num_computed_tokens + n, self.blocks.block_size) - len(req.block_ids)
        while need > self.blocks.num_free:
            victim = next((r for r in reversed(self.running) if r is not req), None)
            if victim is None:
                return False
            self._preempt(victim, preempted)
        self.blocks.grow(req.block_ids, req.num_computed_tokens + n)
        return True

    def _preempt(self, req: Request, preempted: list[str]) -> None:
        self.running.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids, req.num_computed_tokens = [], 0
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        preempted.append(req.request_id)

    def _admit(self, plan: dict[str, int], budget: int, chunked: bool) -> None:
        """Move waiting requests into the batch while budget, sequence slots and blocks allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = req.num_uncomputed_tokens
            if n > budget:
                if not chunked and plan:
                    break
                n = budget if chunked else n  # vllm: a lone prompt larger than the budget runs whole
            need = blocks_needed(req.num_computed_tokens + n, self.blocks.block_size) - len(req.block_ids)
            if need > self.blocks.num_free:
                break
            self.waiting.popleft()
            self.blocks.grow(req.block_ids, req.num_computed_tokens + n)
            req.status = Status.RUNNING
            self.running.append(req)
            plan[req.request_id] = n
            budget -= n

    def _still_running(self, plan: dict[str, int]) -> dict[str, int]:
        """Drop plan entries of requests preempted after they were planned."""
        return {rid: n for rid, n in plan.items() if self.requests[rid].status is Status.RUNNING}

    def update(self, plan: StepPlan, output: StepOutput) -> StepEvents:
        """Advance progress by the planned tokens and append sampled tokens; ``tokens`` are the
        requests that received one (the instance checks their stop conditions)."""
        got = []
        for s in plan.seqs:
            req = self.requests.get(s.request_id)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_tokens
            if s.request_id in output.sampled:
                assert req.num_computed_tokens == req.num_tokens
                req.output_token_ids.append(output.sampled[s.request_id])
                got.append(req)
        return StepEvents(tokens=tuple(got))


class SarathiScheduler(CoupledScheduler):
    """Stall-free hybrid batches (Sarathi-Serve Alg. 3)."""

    name = "sarathi"

    def schedule(self) -> StepPlan:
        preempted: list[str] = []
        plan: dict[str, int] = {}
        budget = self.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_uncomputed_tokens == 1]
        partial = [r for r in self.running if r.num_uncomputed_tokens > 1]
        for req in decodes:
            if req in self.running and self._grow(req, 1, preempted):
                plan[req.request_id] = 1
                budget -= 1
        for req in partial:
            if budget <= 0 or req not in self.running:
                continue
            n = min(req.num_uncomputed_tokens, budget)
            if self._grow(req, n, preempted):
                plan[req.request_id] = n
                budget -= n
        self._admit(plan, budget, chunked=True)
        return self._to_plan(self._still_running(plan), preempted)


class VllmScheduler(CoupledScheduler):
    """Prefill-first iterations (Sarathi-Serve Alg. 2, vLLM's scheduler before chunked prefill)."""

    name = "vllm"

    def schedule(self) -> StepPlan:
        preempted: list[str] = []
        plan: dict[str, int] = {}
        self._admit(plan, self.max_num_batched_tokens, chunked=False)
        if not plan:
            for req in list(self.running):
                if req in self.running and self._grow(req, req.num_uncomputed_tokens, preempted):
                    plan[req.request_id] = req.num_uncomputed_tokens
        return self._to_plan(self._still_running(plan), preempted)
