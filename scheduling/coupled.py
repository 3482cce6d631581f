"""The coupled scheduler: one instance does prefill and decode, vLLM-v1 style.

``schedule()`` returns ``{request_id: num_tokens}``: how far each request's
``num_computed_tokens`` moves this step (a prompt chunk, a recompute, or 1 for a decode).
``update()`` applies the sampled tokens. Policies differ only in ordering and budget:

- ``sarathi`` (stall-free, Sarathi-Serve Alg. 3): all running decodes first, then the partly
  done prefills' next chunks, then new requests, within ``max_num_batched_tokens``.
- ``vllm`` (prefill-first, Sarathi-Serve Alg. 2): when new requests fit, a prefill-only
  iteration of whole prompts; otherwise a decode-only iteration. Never mixes the two.

Preemption is by recompute: the newest running request gives its blocks back and goes to the
front of the waiting queue with ``num_computed_tokens = 0``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduling.block_manager import BlockManager, blocks_needed
from scheduling.request import Request, Status

POLICIES = ("sarathi", "vllm")


@dataclass(frozen=True)
class SchedulerOutput:
    num_scheduled: dict[str, int]  # request_id -> tokens to compute this step
    preempted_ids: tuple[str, ...] = ()

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled.values())

    @property
    def empty(self) -> bool:
        return not self.num_scheduled


class CoupledScheduler:
    policies: tuple[str, ...] = POLICIES  # names this class schedules; subclasses add their own

    def __init__(self, blocks: BlockManager, policy: str = "sarathi", max_num_batched_tokens: int = 512,
                 max_num_seqs: int = 256):
        if policy not in self.policies:
            raise ValueError(f"unknown batching policy {policy!r}; choose one of {self.policies}")
        assert max_num_batched_tokens >= 1 and max_num_seqs >= 1
        self.blocks, self.policy = blocks, policy
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    def add(self, req: Request) -> None:
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

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish(req, "abort")
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        preempted: list[str] = []
        if self.policy == "vllm":
            plan = self._prefill_first(preempted)
        else:
            plan = self._stall_free(preempted)
        assert sum(plan.values()) <= self.max_num_batched_tokens or len(plan) == 1
        return SchedulerOutput(plan, tuple(preempted))

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

    def _stall_free(self, preempted: list[str]) -> dict[str, int]:
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
        # drop plan entries of requests preempted after they were planned
        return {rid: n for rid, n in plan.items() if self.requests[rid].status is Status.RUNNING}

    def _prefill_first(self, preempted: list[str]) -> dict[str, int]:
        plan: dict[str, int] = {}
        self._admit(plan, self.max_num_batched_tokens, chunked=False)
        if plan:
            return plan
        for req in list(self.running):
            if req in self.running and self._grow(req, req.num_uncomputed_tokens, preempted):
                plan[req.request_id] = req.num_uncomputed_tokens
        return {rid: n for rid, n in plan.items() if self.requests[rid].status is Status.RUNNING}

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

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance progress by the planned tokens and append sampled tokens; returns requests
        that received a token (the caller checks their stop conditions)."""
        got = []
        for rid, n in out.num_scheduled.items():
            req = self.requests.get(rid)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += n
            if rid in sampled:
                assert req.num_computed_tokens == req.num_tokens
                req.output_token_ids.append(sampled[rid])
                got.append(req)
        return got
