"""ALISE speculative preemptive scheduling, as a coupled batching policy (ALISE §3–4).

Every step ranks all unfinished jobs, running or not, and the batch is the best-ranked prefix
that fits the token budget, the sequence cap and the device blocks::

    rank = (level, arrival)    level = clamp(L(est. remaining) + demotions) - promotions
    tier -1 (starving): waited >= num_levels · aging_s, served oldest wait first
    tier 0 .. num_levels-1: level 0 = shortest estimated remaining time (latency_model.py)

- **Iteration-level preemption.** A running job left out of the batch is preempted; a
  better-ranked arrival takes its place the very next step. A prompt runs in chunks of what is
  left of the token budget, as in Sarathi, so one long prompt cannot hold the step.
- **Aging.** Each ``aging_s`` spent waiting promotes a job one level, and a promotion is kept
  once earned (dropping it when the job runs would let the next short arrival preempt it again,
  turning aging into one token per period). After ``num_levels`` promotions the job is
  *starving*: above every level, ordered by when its wait began.
- **Demotion.** A job that outgrows its predicted length is demoted one level and its
  prediction doubled (never past ``max_tokens``).
- **KV of waiting jobs (Algorithm 2).** Each step estimates every waiting job's wait (EWT: the
  estimated work ranked ahead of it, shared by the batch's lanes). A preempted job expected
  back soon keeps its KV on the device; one expected to wait ``swap_after_s`` or longer is
  swapped to host blocks (kept when the host is full: dropping KV nobody needs the room for
  only wastes work); a swapped job whose EWT falls under half that (hysteresis) is
  prefetched back when blocks are spare. When a better-ranked job needs blocks, the worst-ranked
  holders are evicted: swapped when the host has room, otherwise recomputed later.

The scheduler only decides. The plan's ``swap_out`` holds ``(device, host)`` block pairs and
``swap_in`` ``(host, device)`` pairs; the runner copies swap-outs first, then swap-ins, then runs
the forward (a block freed by a swap-out may be reused in the same step). Host blocks freed by
a swap-in are released only after the step's swap-outs were chosen, so no host block is both
read and written in one step. How a host copy is stored (the model dtype, or INT8 with
channel-wise scales, ALISE Eq. 8) is the runner's business (``EngineConfig.swap_dtype``): the
scheduler only counts host blocks.

Aging bound: a job waits at most ``num_levels · aging_s + N · Δ`` (``AliseConfig.aging_bound_s``)
where N bounds the unfinished jobs and Δ the time between two ``schedule()`` calls. Why: after
``num_levels · aging_s`` the job is starving; starving jobs are ranked by wait start and every
step serves the best-ranked job (it can evict everyone and ``add`` checked it fits alone), so at
most N - 1 starving jobs go before it, one per step at worst, and any job that starts starving
later began waiting later and queues behind it.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from scheduling.block_manager import BlockManager, blocks_needed
from scheduling.clock import Clock
from scheduling.coupled import BatchingConfig, CoupledScheduler
from scheduling.dispatch import predicted_max_output
from scheduling.latency_model import LatencyModel
from scheduling.prefix import share_prefix
from scheduling.request import Request, Status
from scheduling.step import StepEvents, StepOutput, StepPlan

KV_ACTIONS = ("keep", "swap_out", "swap_in", "recompute")


@dataclass(frozen=True)
class AliseConfig:
    num_levels: int = 4
    level_base_s: float = 1.0  # level 0 holds jobs estimated to need less than this
    level_ratio: float = 4.0  # each further level spans ``level_ratio`` times more time
    aging_s: float = 5.0  # waiting this long promotes a job one level (math.inf: no aging)
    swap_after_s: float = 2.0  # a preempted job expected to wait this long goes to host

    def __post_init__(self):
        if self.num_levels < 1 or self.level_base_s <= 0 or self.level_ratio <= 1:
            raise ValueError(f"bad priority levels in {self}")
        if self.aging_s <= 0 or self.swap_after_s < 0:
            raise ValueError(f"aging_s must be > 0 and swap_after_s >= 0 in {self}")

    def level_of(self, remaining_s: float) -> int:
        """Queue level of a job estimated to need ``remaining_s`` more seconds."""
        if remaining_s < self.level_base_s:
            return 0
        level = 1 + int(math.log(remaining_s / self.level_base_s, self.level_ratio))
        return min(self.num_levels - 1, level)

    def aging_bound_s(self, step_s: float, max_jobs: int) -> float:
        """Longest a job can wait: ``num_levels · aging_s + max_jobs · step_s`` (module doc)."""
        return self.num_levels * self.aging_s + max_jobs * step_s


@dataclass(frozen=True)
class KVDecision:
    """What happened to one job's KV this step, and the expected wait that decided it
    (None when device blocks were needed at once and the wait did not matter)."""

    request_id: str
    action: str  # one of KV_ACTIONS
    ewt_s: Optional[float] = None


@dataclass
class _Job:
    """Scheduler-private state of one request (``Request`` stays policy-neutral)."""

    seq: int  # arrival order: the tiebreak within a level
    predicted: int  # output-token bound; doubled when outgrown
    wait_since: Optional[float]  # when its current wait began; None while it runs
    penalty: int = 0  # demotions from outgrown predictions
    boost: int = 0  # promotions already earned by waiting
    host_ids: list[int] = field(default_factory=list)  # its KV on the host, when swapped


@dataclass
class _Step:
    """What one ``schedule()`` call accumulates."""

    now: float
    plan: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    decisions: list[KVDecision] = field(default_factory=list)
    host_to_free: list[int] = field(default_factory=list)  # freed after all swap-outs
    evicted: set[str] = field(default_factory=set)


class AliseScheduler(CoupledScheduler):
    """ALISE in the coupled engine loop; its plans carry swaps and ``kv_decisions``."""

    name = "alise"
    uses_swap = True

    def __init__(self, blocks: BlockManager, config: BatchingConfig = BatchingConfig(),
                 clock: Optional[Clock] = None, *, host_blocks: Optional[BlockManager] = None,
                 alise: AliseConfig = AliseConfig(), latency: LatencyModel = LatencyModel()):
        super().__init__(blocks, config, clock)
        assert host_blocks is None or host_blocks.block_size == blocks.block_size
        self.alise, self.latency = alise, latency
        self.host = host_blocks
        self._jobs: dict[str, _Job] = {}
        self._seq = itertools.count()
        self.num_demotions = 0

    # ---- queue management -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        # a preemptive policy may have to run any job alone: all of it must fit the device
        if blocks_needed(req.max_total_tokens(), self.blocks.block_size) > self.blocks.num_blocks:
            raise ValueError(f"request {req.request_id} may outgrow the instance's KV blocks")
        super().add_request(req)
        self._jobs[req.request_id] = _Job(next(self._seq), predicted_max_output(req), self.clock.now())

    def finish(self, req: Request, reason: str) -> None:
        job = self._jobs.pop(req.request_id, None)
        if job is not None and job.host_ids:
            self.host.free(job.host_ids)
        super().finish(req, reason)

    # ---- ranking ------------------------------------------------------------------------
    def _promotions(self, job: _Job, now: float) -> int:
        return 0 if job.wait_since is None else int((now - job.wait_since) // self.alise.aging_s)

    def _rank(self, req: Request, remaining_s: float, now: float) -> tuple:
        job, top = self._jobs[req.request_id], self.alise.num_levels - 1
        promotions = self._promotions(job, now)
        if promotions > top:  # starving: above every level, oldest wait first
            return (-1, job.wait_since, job.seq)
        level = min(top, self.alise.level_of(remaining_s) + job.penalty)
        return (max(0, level - job.boost - promotions), 0.0, job.seq)

    def level(self, request_id: str) -> int:
        """The job's level now: -1 starving, then 0 (served first) .. num_levels - 1."""
        req = self.requests[request_id]
        return self._rank(req, self.remaining_s(req), self.clock.now())[0]

    def remaining_s(self, req: Request) -> float:
        """Estimated seconds ``req`` still needs, with its current (maybe doubled) prediction."""
        return self.latency.estimate_remaining(req, self._jobs[req.request_id].predicted)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        step = _Step(self.clock.now())
        remaining = {rid: self.remaining_s(r) for rid, r in self.requests.items()}
        order = sorted(self.running + list(self.waiting),
                       key=lambda r: self._rank(r, remaining[r.request_id], step.now))
        selected = self._select(order, step)
        waits = self._expected_waits(order, selected, remaining)
        for req in order:
            if req.request_id not in selected:
                self._park(req, waits[req.request_id], len(selected), step)
        self._requeue(order, selected, step.now)
        if self.host is not None:
            self.host.free(step.host_to_free)
        assert step.plan or not order, "the best-ranked job always fits"
        assert sum(step.plan.values()) <= self.max_num_batched_tokens
        return self._to_plan(step.plan, step.preempted, swap_out=tuple(step.swap_out), swap_in=tuple(step.swap_in),
                             kv_decisions=tuple(step.decisions))

    def _select(self, order: list[Request], step: _Step) -> set[str]:
        """The best-ranked jobs that fit: a prompt chunk or one decode token each."""
        budget, selected = self.max_num_batched_tokens, set()
        for i, req in enumerate(order):
            if budget <= 0 or len(selected) >= self.max_num_seqs:
                break
            if req.request_id in step.evicted:
                continue  # its KV just left to make room for a better-ranked job
            shared = 0
            if not self._jobs[req.request_id].host_ids:
                shared = share_prefix(self.blocks, req)  # cached (or a sibling's) prompt blocks, if here
            n = min(req.num_uncomputed_tokens, budget)
            if self._make_room(req, n, order[i + 1:], step):
                step.plan[req.request_id] = n
                budget -= n
                selected.add(req.request_id)
            elif shared and len(req.block_ids) == shared:  # left out: hold no cached block while waiting
                self.blocks.free(req.block_ids)  # (a wait would otherwise swap them out to host)
                req.block_ids, req.num_computed_tokens = [], 0
        return selected

    def _make_room(self, req: Request, n: int, worse: list[Request], step: _Step) -> bool:
        """Give ``req`` device blocks for ``n`` more tokens, evicting the worst-ranked holders
        first; False (nothing evicted) when even all of them would not make enough room."""
        held = len(req.block_ids) or len(self._jobs[req.request_id].host_ids)  # swapped: all come back
        need = max(held, blocks_needed(req.num_computed_tokens + n, self.blocks.block_size)) - len(req.block_ids)
        if need > self.blocks.num_free:
            holders = [r for r in reversed(worse) if r.block_ids]
            # a block a holder shares with a sibling outside ``holders`` (or with ``req``) stays
            if need > self.blocks.num_free + self.blocks.num_freed_by([r.block_ids for r in holders]):
                return False
            for victim in holders:
                if need <= self.blocks.num_free:
                    break
                self._evict(victim, step)
        if self._jobs[req.request_id].host_ids:
            self._swap_in(req, step, ewt_s=0.0)
        self.blocks.grow(req.block_ids, req.num_computed_tokens + n)
        return True

    def _expected_waits(self, order: list[Request], selected: set[str],
                        remaining: dict[str, float]) -> dict[str, float]:
        """EWT of each job left out: the estimated work ranked ahead of it, shared among the
        batch's lanes (a fluid view of continuous batching)."""
        lanes, ahead, waits = max(1, len(selected)), 0.0, {}
        for req in order:
            if req.request_id not in selected:
                waits[req.request_id] = ahead / lanes
            ahead += remaining[req.request_id]
        return waits

    # ---- KV of jobs left out --------------------------------------------------------------
    def _park(self, req: Request, ewt_s: float, num_selected: int, step: _Step) -> None:
        """Apply the expected-wait rule to a job left out of this step's batch."""
        rid, job = req.request_id, self._jobs[req.request_id]
        if req.status is Status.RUNNING:
            step.preempted.append(rid)
            req.num_preemptions += 1
            self.num_preemptions += 1
        if rid in step.evicted:
            return  # already moved for a better-ranked job
        if req.block_ids:
            if ewt_s >= self.alise.swap_after_s and self._host_fits(len(req.block_ids)):
                self._swap_out(req, step, ewt_s)
            elif req.status is Status.RUNNING:
                step.decisions.append(KVDecision(rid, "keep", ewt_s))
        elif job.host_ids and ewt_s < self.alise.swap_after_s / 2:
            # prefetch, leaving a block of growth for each job in the batch
            if len(job.host_ids) + num_selected <= self.blocks.num_free:
                self._swap_in(req, step, ewt_s)

    def _host_fits(self, num_blocks: int) -> bool:
        return self.host is not None and self.host.can_allocate(num_blocks)

    def _evict(self, req: Request, step: _Step) -> None:
        """Free ``req``'s device blocks now: to host when it has room, else drop (recompute)."""
        if self._host_fits(len(req.block_ids)):
            self._swap_out(req, step, None)
            return
        self.blocks.free(req.block_ids)
        req.block_ids, req.num_computed_tokens = [], 0
        step.evicted.add(req.request_id)
        step.decisions.append(KVDecision(req.request_id, "recompute", None))

    def _swap_out(self, req: Request, step: _Step, ewt_s: Optional[float]) -> None:
        job = self._jobs[req.request_id]
        job.host_ids = self.host.allocate(len(req.block_ids))
        step.swap_out.extend(zip(req.block_ids, job.host_ids))
        self.blocks.free(req.block_ids)
        req.block_ids = []  # num_computed_tokens stays: the KV lives on in host memory
        step.evicted.add(req.request_id)
        step.decisions.append(KVDecision(req.request_id, "swap_out", ewt_s))

    def _swap_in(self, req: Request, step: _Step, ewt_s: float) -> None:
        job = self._jobs[req.request_id]
        assert not req.block_ids and job.host_ids
        req.block_ids = self.blocks.allocate(len(job.host_ids))
        step.swap_in.extend(zip(job.host_ids, req.block_ids))
        step.host_to_free.extend(job.host_ids)
        job.host_ids = []
        step.decisions.append(KVDecision(req.request_id, "swap_in", ewt_s))

    # ---- bookkeeping ------------------------------------------------------------------------
    def _requeue(self, order: list[Request], selected: set[str], now: float) -> None:
        """Batch -> ``running``, the rest -> ``waiting`` (both in rank order); waits start/end."""
        running, waiting = [], deque()
        for req in order:
            job = self._jobs[req.request_id]
            if req.request_id in selected:
                if job.wait_since is not None:  # the wait ends: keep what it earned
                    job.boost = min(self.alise.num_levels, job.boost + self._promotions(job, now))
                    job.wait_since = None
                req.status = Status.RUNNING
                running.append(req)
            else:
                if job.wait_since is None:
                    job.wait_since = now
                if req.status is Status.RUNNING:
                    req.status = Status.PREEMPTED
                waiting.append(req)
        self.running, self.waiting = running, waiting

    def update(self, plan: StepPlan, output: StepOutput) -> StepEvents:
        """As ``CoupledScheduler.update``; a job past its predicted length is demoted one level
        and its prediction doubled."""
        events = super().update(plan, output)
        for req in events.tokens:
            job = self._jobs[req.request_id]
            if req.num_output_tokens > job.predicted:
                job.predicted = min(2 * job.predicted, req.sampling.max_tokens)
                job.penalty += 1
                self.num_demotions += 1
        return events

    def predicted_output(self, request_id: str) -> int:
        """The job's current output-token bound (after any doublings)."""
        return self._jobs[request_id].predicted
