"""The prefill instance's local scheduler (TetriInfer §3.3): queues, policy and chunk planning.

Arrivals enter the *raw queue*. Whenever the *scheduled queue* runs empty, the next group of
up to ``sched_batch`` requests moves over in arrival order and is ordered by the policy (FCFS,
SJF, LJF) *within that group only*, so a long prompt under SJF waits at most one group.

Prompts from the scheduled queue, in order, are cut into one chunk of exactly ``chunk_size``
tokens; a prompt may span chunks and several short prompts may share one::

    chunk (chunk_size = 16):  | a[8:12) | b[0:6)  | c[0:3)  | pad x3 |
                                 a ends    b ends    c goes on next chunk

It keeps the scheduler contract (scheduling/base.py): ``schedule()`` returns the chunk as a
``StepPlan`` (one ``SeqStep`` per slice, then the padding) and allocates the blocks it needs;
``update(plan, output)`` moves each request's ``num_computed_tokens`` on. One plan is in flight at
a time. Prompts whose last token was computed wait in ``finished_prefills`` with their blocks
until ``release`` (KV handed to a decode instance), ``finish`` (their first token was the last)
or ``abort``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Collection, Mapping, Optional

from scheduling.base import Scheduler
from scheduling.block_manager import BlockManager, blocks_needed
from scheduling.clock import Clock
from scheduling.prefix import note_cached, publish_prefix, share_prefix, uncached_left
from scheduling.request import Request, Status
from scheduling.step import EMPTY_PLAN, StepEvents, StepOutput, StepPlan, seq_step


@dataclass(frozen=True)
class PrefillConfig:
    chunk_size: int = 512  # tokens per chunk, padding included
    sched_batch: int = 16  # PrefillSchedBatch: requests ordered together
    pad: bool = True  # pad every chunk up to chunk_size (fixed-size chunks, as the paper)

    def __post_init__(self):
        if self.chunk_size < 1 or self.sched_batch < 1:
            raise ValueError(f"chunk_size and sched_batch must be >= 1, got {self}")


class PrefillScheduler(Scheduler):
    """FCFS base; subclasses change only ``order_group``.

    Besides the contract: ``release``, ``take_unstarted``, ``finished_prefills``, ``raw_ids`` /
    ``scheduled_ids``.
    """

    name = "fcfs"
    role = "prefill"

    def __init__(self, blocks: BlockManager, config: PrefillConfig = PrefillConfig(),
                 clock: Optional[Clock] = None):
        super().__init__(blocks, clock)
        self.config = config
        self._requests: dict[str, Request] = {}  # every request this instance holds
        self._raw: deque[Request] = deque()
        self._scheduled: deque[Request] = deque()
        self._finished: dict[str, Request] = {}  # prompt computed, blocks held until release
        self._inflight: Optional[StepPlan] = None

    # --- queues ---------------------------------------------------------------------------
    def order_group(self, group: list[Request]) -> list[Request]:
        """Order one sched batch (already in arrival order). FCFS keeps it."""
        return group

    def add_request(self, request: Request) -> None:
        """A new arrival, to the raw queue. Its prompt must fit the whole pool or it never runs."""
        assert request.request_id not in self._requests, f"duplicate {request.request_id}"
        assert request.num_computed_tokens == 0 and not request.block_ids, request.request_id
        num_blocks = blocks_needed(request.num_prompt_tokens, self.blocks.block_size)
        if num_blocks > self.blocks.num_blocks:
            raise ValueError(f"prompt of {request.num_prompt_tokens} tokens exceeds the KV pool")
        request.status = Status.WAITING
        self._requests[request.request_id] = request
        note_cached(self.blocks, request)
        self._raw.append(request)

    def _refill(self) -> bool:
        """Move the next sched batch from the raw queue, ordered by policy; False if none."""
        n = min(self.config.sched_batch, len(self._raw))
        group = [self._raw.popleft() for _ in range(n)]
        self._scheduled.extend(self.order_group(group))
        return n > 0

    @property
    def raw_ids(self) -> list[str]:
        return [r.request_id for r in self._raw]

    @property
    def scheduled_ids(self) -> list[str]:
        return [r.request_id for r in self._scheduled]

    @property
    def finished_prefills(self) -> tuple[Request, ...]:
        """Requests whose whole prompt is computed, holding their blocks: ready for dispatch."""
        return tuple(self._finished.values())

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens still to compute here (less an unstarted prompt's cached prefix here): the
        load the global scheduler balances."""
        return sum(uncached_left(r, r.num_prompt_tokens - r.num_computed_tokens)
                   for queue in (self._raw, self._scheduled) for r in queue)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def queue_lengths(self) -> tuple[int, int]:
        """Waiting: not yet in a sched batch; running: chunked, or computed and awaiting the handoff."""
        return len(self._raw), len(self._scheduled) + len(self._finished)

    def has_work(self) -> bool:
        return bool(self._raw or self._scheduled)

    # --- schedule / update ----------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan the next chunk and allocate its blocks; empty when nothing can run now."""
        assert self._inflight is None, "update with the previous chunk first"
        budget = self.config.chunk_size
        slices: list[tuple[Request, int]] = []
        i = 0
        while budget > 0 and (i < len(self._scheduled) or self._refill()):
            request = self._scheduled[i]
            i += 1
            share_prefix(self.blocks, request)  # a sibling's prompt blocks, if published here
            want = min(budget, request.num_prompt_tokens - request.num_computed_tokens)
            n = self._fit_blocks(request, want)
            if n == 0:
                break  # out of blocks: this request waits, and so does everyone behind it
            self.blocks.grow(request.block_ids, request.num_computed_tokens + n)
            slices.append((request, n))
            budget -= n
            self._mark_scheduled(request)
            if n < want:
                break  # took the last free blocks
        if not slices:
            return EMPTY_PLAN
        return self._make_plan(slices, budget)

    def _fit_blocks(self, request: Request, want: int) -> int:
        """Tokens of ``want`` that the request's blocks plus the free blocks can hold."""
        capacity = (len(request.block_ids) + self.blocks.num_free) * self.blocks.block_size
        return max(0, min(want, capacity - request.num_computed_tokens))

    def _mark_scheduled(self, request: Request) -> None:
        request.status = Status.RUNNING
        request.times.setdefault("scheduled", self.clock.now())

    def _make_plan(self, slices: list[tuple[Request, int]], budget: int) -> StepPlan:
        seqs, tap_layer = [], 0
        for request, n in slices:
            start = request.num_computed_tokens
            last = start + n == request.num_prompt_tokens  # the first output token is sampled
            tap = last and request.feature_layer > 0  # the length predictor reads the prompt's last token
            tap_layer = max(tap_layer, request.feature_layer if tap else 0)
            seqs.append(seq_step(request, start, start + n, sample=last, tap=tap))
        plan = StepPlan(tuple(seqs), num_pad_tokens=budget if self.config.pad else 0, tap_layer=tap_layer)
        assert plan.num_real_tokens + plan.num_pad_tokens <= self.config.chunk_size, plan
        self._inflight = plan
        return plan

    def update(self, plan: StepPlan, output: StepOutput) -> StepEvents:
        """The chunk ran: advance progress; ``output.sampled`` holds the first token of each
        request whose prompt ended in it. Those are ``StepEvents.prefilled`` (and ``tokens``),
        now in ``finished_prefills``. Slices of requests aborted meanwhile are skipped."""
        assert plan is self._inflight, "update with the plan that is in flight"
        self._inflight = None
        now, done = self.clock.now(), []
        for s in plan.seqs:
            request = self._requests.get(s.request_id)
            if request is None:
                continue
            assert request.num_computed_tokens == s.start_pos, (s, request.num_computed_tokens)
            request.num_computed_tokens = s.end_pos
            publish_prefix(self.blocks, request, s.start_pos)
            request.times.setdefault("chunks", []).append((now, s.num_tokens))  # (end time, its tokens)
            assert blocks_needed(s.end_pos, self.blocks.block_size) <= len(request.block_ids)
            if s.end_pos == request.num_prompt_tokens:
                self._finish_prefill(request, output.sampled)
                done.append(request)
        if done:
            self._scheduled = deque(
                r for r in self._scheduled if r.request_id not in self._finished)
        return StepEvents(tokens=tuple(r for r in done if r.request_id in output.sampled), prefilled=tuple(done))

    def _finish_prefill(self, request: Request, sampled: Mapping[str, int]) -> None:
        request.status = Status.TRANSFERRING
        request.times["prefill_done"] = self.clock.now()
        if request.request_id in sampled:
            request.output_token_ids.append(sampled[request.request_id])
            request.times.setdefault("first_token", self.clock.now())
        self._finished[request.request_id] = request

    # --- leaving --------------------------------------------------------------------------
    def release(self, request_id: str) -> Request:
        """The KV was handed over: free the request's blocks here and forget it."""
        request = self._finished.pop(request_id)
        del self._requests[request_id]
        self._free(request)
        return request

    def finish(self, request: Request, reason: str) -> None:
        """Its first token was its last: nothing to hand over, free the blocks here."""
        self.release(request.request_id)
        request.status, request.finish_reason = Status.FINISHED, reason

    def as_sender(self) -> "PrefillScheduler":
        return self

    def take_unstarted(self, request_ids: Optional[Collection[str]] = None) -> list[Request]:
        """Remove and return the queued requests no chunk has touched yet (they hold no KV; all,
        or those of ``request_ids``): a draining instance hands them to its peers instead of
        computing them itself."""
        planned = set(self._inflight.num_scheduled_tokens) if self._inflight is not None else set()
        taken = [r for r in list(self._raw) + list(self._scheduled)
                 if r.num_computed_tokens == 0 and not r.block_ids and r.request_id not in planned
                 and (request_ids is None or r.request_id in request_ids)]
        ids = {r.request_id for r in taken}
        self._raw = deque(r for r in self._raw if r.request_id not in ids)
        self._scheduled = deque(r for r in self._scheduled if r.request_id not in ids)
        for r in taken:
            del self._requests[r.request_id]
            r.status = Status.WAITING
        return taken

    def abort(self, request_id: str) -> Optional[Request]:
        """Drop the request from whichever queue holds it and free its blocks; None if unknown."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self._raw = deque(r for r in self._raw if r.request_id != request_id)
        self._scheduled = deque(r for r in self._scheduled if r.request_id != request_id)
        self._finished.pop(request_id, None)
        self._free(request)
        request.status = Status.FINISHED
        request.finish_reason = "abort"
        return request

    def _free(self, request: Request) -> None:
        self.blocks.free(request.block_ids)
        request.block_ids = []


class SJFPrefillScheduler(PrefillScheduler):
    """Shortest prompt first within each sched batch (ties keep arrival order)."""

    name = "sjf"

    def order_group(self, group: list[Request]) -> list[Request]:
        return sorted(group, key=lambda r: r.num_prompt_tokens)


class LJFPrefillScheduler(PrefillScheduler):
    """Longest prompt first within each sched batch (ties keep arrival order)."""

    name = "ljf"

    def order_group(self, group: list[Request]) -> list[Request]:
        return sorted(group, key=lambda r: -r.num_prompt_tokens)
