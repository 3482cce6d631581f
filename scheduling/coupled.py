"""Coupled batching: one instance does prefill and decode, vLLM-v1 style.

``schedule()`` decides how far each request's ``num_computed_tokens`` moves this step (a prompt
chunk, a recompute, or 1 for a decode) and returns it as a ``StepPlan``; ``update()`` applies
the sampled tokens. The rules follow the schedulers of Sarathi-Serve's code base (its
``vllm_scheduler.py`` and ``sarathi_scheduler.py``), side by side in docs/BASELINES.md:

- ``vllm`` (prefill-first, Sarathi-Serve Alg. 2, vLLM's scheduler before chunked prefill): while
  waiting requests fit (budget, sequence cap, KV), an iteration of whole prompts only; otherwise
  a decode-only iteration. Never mixes the two. Its budget is the model's context length.
- ``sarathi`` (stall-free, Sarathi-Serve Alg. 3): every running decode first, then the next
  chunks of prompts already admitted, then new requests, within ``max_num_batched_tokens``; with
  a ``StepRoom`` (``BatchingConfig.step_room``, serve's default) the prompts may take more: what
  the step's decodes, at their contexts, leave of the step time the budget was sized for.
- ``alise`` (scheduling/alise.py): speculative, preemptive, from predicted lengths.

Shared by vllm and sarathi, as in their block managers: a request is admitted only when blocks
for its whole sequence are free above a watermark (1% of the pool), and gets them all at once,
so an admitted prompt's chunks never need blocks again; a decode that finds no free block for
its next token preempts the lowest-priority running request (first come, first served: the
latest arrival), by recompute: its blocks are freed and it goes to the front of the waiting
queue with ``num_computed_tokens = 0``.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

from scheduling.base import Scheduler
from scheduling.block_manager import BlockManager, blocks_needed
from scheduling.clock import Clock
from scheduling.prefix import note_cached, publish_prefix, share_prefix, uncached_left
from scheduling.request import Request, Status
from scheduling.step import EMPTY_PLAN, StepEvents, StepOutput, StepPlan, seq_step


ROOM_MOST = 1 << 14  # prompt rows a sized step holds at most (the cost model prices each size it tries once)


@dataclass(frozen=True)
class StepRoom:
    """The budget per step, sized as Sarathi-Serve sizes its one budget, but at the step's own
    decodes: the most prompt rows whose step stays within ``limit_s``. The one budget is sized for
    a worst case (32 decodes at the model's whole context: 48 rows of a step of about a second, the
    default model on one core), and a step whose decodes read 300 tokens each has room for
    hundreds more in the same time. ``step_s(prompt_rows, prompt_start, decode_rows, decode_context)``: a step's
    seconds (the device's cost model: prompt rows as one chunk after ``prompt_start`` cached
    tokens, decode rows reading ``decode_context`` tokens between them)."""

    limit_s: float
    step_s: Callable[[int, int, int, int], float]
    tile: int = 16  # rows are sized in multiples of this
    # the limit of a step with no decodes (None: ``limit_s``): no decode's mean is at stake there,
    # only the one step a request arriving meanwhile waits for (serve: the SLO's token gap where
    # ``limit_s`` is its TPOT)
    alone_s: Optional[float] = None

    def __post_init__(self):
        if not self.limit_s > 0 or self.tile < 1 or (self.alone_s is not None and not self.alone_s > 0):
            raise ValueError(f"step room needs limit_s > 0, alone_s > 0 and tile >= 1, got {self.limit_s}, "
                             f"{self.alone_s}, {self.tile}")

    def limit(self, decodes: int) -> float:
        """The limit of a step with ``decodes`` decode rows."""
        return self.alone_s if decodes == 0 and self.alone_s is not None else self.limit_s

    def rows(self, decodes: int, context: int, start: int, most: int) -> int:
        """Prompt rows beside ``decodes`` decode rows reading ``context`` tokens, the chunk after
        ``start`` cached tokens: the most, up to ``most``, within the limit (0 if none fits)."""
        limit = self.limit(decodes)
        if most <= 0 or self.step_s(most, start, decodes, context) <= limit:
            return max(0, most)
        lo, hi = 0, most  # lo fits (no rows), hi does not: a step's time grows with its rows
        while hi - lo > self.tile:
            mid = (lo + hi) // 2
            if self.step_s(mid, start, decodes, context) <= limit:
                lo = mid
            else:
                hi = mid
        return lo // self.tile * self.tile


@dataclass(frozen=True)
class BatchingConfig:
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 256  # requests in one batch at most
    watermark: float = 0.01  # share of the pool kept free when admitting (vLLM's block manager)
    step_room: Optional[StepRoom] = None  # sarathi: prompt rows sized a step at a time (None: the budget)

    def __post_init__(self):
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens and max_num_seqs must be >= 1, got {self}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


class CoupledScheduler(Scheduler):
    """The queues and bookkeeping every coupled policy shares; each policy is its ``schedule``."""

    role = "coupled"
    uses_swap: ClassVar[bool] = False  # True: needs host blocks (``host_blocks``) for swapped KV

    def __init__(self, blocks: BlockManager, config: BatchingConfig = BatchingConfig(),
                 clock: Optional[Clock] = None):
        super().__init__(blocks, clock)
        self.config = config
        self.max_num_batched_tokens, self.max_num_seqs = config.max_num_batched_tokens, config.max_num_seqs
        self.watermark_blocks = int(config.watermark * blocks.num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._priority: dict[str, tuple] = {}  # first come, first served: (arrival time, order)
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        need = blocks_needed(req.num_tokens + 1, self.blocks.block_size)
        if need + self.watermark_blocks > self.blocks.num_blocks:
            raise ValueError(f"request {req.request_id} needs more KV blocks than the instance has")
        self.requests[req.request_id] = req
        self._priority[req.request_id] = (req.arrival_time, next(self._arrivals))
        note_cached(self.blocks, req)
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
        self._priority.pop(req.request_id, None)

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
        """Prompt tokens waiting (less a waiting prompt's cached prefix here), plus a little for each
        running request (it still decodes)."""
        return sum(uncached_left(r, r.num_uncomputed_tokens) for r in self.waiting) + 4 * len(self.running)

    def kv_outlook(self, expected_output_tokens: int, floor: Optional[int] = None) -> int:
        """Blocks free once every request here has grown to its prompt plus ``expected_output_tokens``
        out (one already past that: one token more), less those it holds now: the room a new
        prompt would find while they decode. Negative where they would not all fit; with ``floor``,
        ``max(that, floor)``, and the walk of the waiting queue stops once below it (an overloaded
        instance's thousands of waiting requests are not summed on every placement)."""
        bs, left = self.blocks.block_size, self.blocks.num_free
        for queue in (self.running, self.waiting):
            for r in queue:
                if floor is not None and left < floor:
                    return floor
                total = len(r.prompt_token_ids) + max(expected_output_tokens, len(r.output_token_ids) + 1)
                left -= max(0, blocks_needed(total, bs) - len(r.block_ids))
        return left if floor is None else max(left, floor)

    # ---- one step -----------------------------------------------------------------------
    def _to_plan(self, plan: dict[str, int], preempted: list[str], **extra) -> StepPlan:
        """A policy's decision ``{request_id: num_tokens}`` as the step's ``StepPlan``."""
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

    # ---- blocks and preemption (vllm, sarathi) -----------------------------------------------
    def _can_admit(self, req: Request) -> bool:
        """Blocks for the whole sequence are free above the watermark (vLLM's ``can_allocate``)."""
        need = blocks_needed(req.num_tokens, self.blocks.block_size) - len(req.block_ids)
        return self.blocks.num_free - need >= self.watermark_blocks

    def _admit(self, req: Request) -> None:
        """Waiting -> running with blocks for its whole sequence (its chunks need none later); a
        sibling's published prompt blocks first, when it has them (scheduling/prefix.py)."""
        self.waiting.remove(req)
        share_prefix(self.blocks, req)
        self.blocks.grow(req.block_ids, req.num_tokens)
        req.status = Status.RUNNING
        self.running.append(req)

    def _sort_running(self) -> None:
        self.running.sort(key=lambda r: self._priority[r.request_id])

    def _decode_or_preempt(self, req: Request, lower: list[Request], preempted: list[str]) -> bool:
        """Blocks for ``req``'s next token, preempting from the end of ``lower`` (the running
        requests of lower priority not yet planned), then ``req`` itself; True if it runs."""
        while blocks_needed(req.num_tokens, self.blocks.block_size) - len(req.block_ids) > self.blocks.num_free:
            victim = lower.pop() if lower else req
            self._preempt(victim, preempted)
            if victim is req:
                return False
        self.blocks.grow(req.block_ids, req.num_tokens)
        return True

    def _preempt(self, req: Request, preempted: list[str]) -> None:
        """By recompute: the KV is dropped, the request waits at the front of the queue."""
        self.running.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids, req.num_computed_tokens = [], 0
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        preempted.append(req.request_id)

    def update(self, plan: StepPlan, output: StepOutput) -> StepEvents:
        """Advance progress by the planned tokens and append sampled tokens; ``tokens`` are the
        requests that received one (the instance checks their stop conditions)."""
        got = []
        for s in plan.seqs:
            req = self.requests.get(s.request_id)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_tokens
            publish_prefix(self.blocks, req, s.start_pos)
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
        self._sort_running()
        queue, prefilling, context = list(self.running), [], 0
        while queue:  # decodes first, in priority order; a prompt already admitted waits its turn
            req = queue.pop(0)
            if req.num_uncomputed_tokens > 1:
                prefilling.append(req)
            elif self._decode_or_preempt(req, queue, preempted):
                plan[req.request_id] = 1
                budget -= 1
                context += req.num_tokens
        budget = self._prompt_rows(budget, len(plan), context, prefilling)
        for req in prefilling:  # the next chunk of every admitted prompt (its blocks are there)
            if req.status is Status.RUNNING and budget > 0:
                plan[req.request_id] = min(req.num_uncomputed_tokens, budget)
                budget -= plan[req.request_id]
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self._can_admit(req):
                break
            self._admit(req)
            plan[req.request_id] = min(req.num_uncomputed_tokens, budget)
            budget -= plan[req.request_id]
        return self._to_plan(plan, preempted)

    def _prompt_rows(self, left: int, decodes: int, context: int, prefilling: list[Request]) -> int:
        """Rows this step's prompts may take: ``left`` (what its decodes leave of the budget), or,
        with a step room, the most that keeps the step within its limit beside these ``decodes``
        (reading ``context`` tokens), where that is more. Sized for the prompts there are (the
        admitted ones' chunks, then the queue's, walked only as far as the room could reach)."""
        room = self.config.step_room
        if room is None:
            return left
        most = room.rows(decodes, context, 0, ROOM_MOST)  # the room, were every row the start of a prompt
        want, start = 0, None
        for req in itertools.chain(prefilling, self.waiting):
            if want >= most:
                break
            want += req.num_uncomputed_tokens
            start = req.num_computed_tokens if start is None else start
        if want <= left:
            return left
        return max(left, room.rows(decodes, context, start or 0, min(want, most)))


class VllmScheduler(CoupledScheduler):
    """Prefill-first iterations (Sarathi-Serve Alg. 2, vLLM's scheduler before chunked prefill)."""

    name = "vllm"

    def schedule(self) -> StepPlan:
        preempted: list[str] = []
        plan: dict[str, int] = {}
        batched = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = req.num_uncomputed_tokens
            # a prompt longer than the budget runs alone (vLLM's budget is the context length)
            if not self._can_admit(req) or (plan and batched + n > self.max_num_batched_tokens):
                break
            self._admit(req)
            plan[req.request_id] = req.num_uncomputed_tokens  # n, less what a sibling's blocks hold
            batched += plan[req.request_id]
        if plan:
            return self._to_plan(plan, preempted)
        self._sort_running()
        queue = list(self.running)
        while queue:
            req = queue.pop(0)
            if self._decode_or_preempt(req, queue, preempted):
                plan[req.request_id] = req.num_uncomputed_tokens
        return self._to_plan(plan, preempted)
