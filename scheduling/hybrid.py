"""The adaptive mode's instance scheduler: decodes plus budgeted prompt chunks (issue 24).

In ``--mode adaptive`` every instance runs this scheduler, whatever its role; the role decides
only where a finished prompt's KV goes and how the global placement ranks the instance
(scheduling/placement.py)::

    add_request ─► waiting ─admit (blocks for the whole prompt)─► running ─┬─ decode row: 1 token
                                                                           └─ prompt rows: chunks
    a prompt's last chunk samples its first token, then:
        decode role  ─► it decodes here: its KV never moves
        prefill role ─► finished_prefills ─► release (KV handed over) | keep (decodes here)
    mark_migrating ─► after its next token ─► finished_prefills ─► release (moved elsewhere)
                                                                   | keep (it did not move)

A step is Sarathi-Serve's stall-free iteration over a decode instance's queues: every running
decode first, one row each, then the next chunks of admitted prompts in admission order within
``token_budget - decodes`` (at least ``min_chunk``, so a prompt always moves on). A step with no
decode in it has no token gap to protect, so its prompts run whole, as vLLM's prompt step runs
them: in admission order while they fit the budget, one longer than the budget alone. The budget is
the one ``aserve profile token-budget`` (or the measured cost model) finds for the TBT SLO, so
a decode never waits for a whole prompt. Admission and preemption are the decode scheduler's:
greedy, preempting the newest running request (a prompt mid-way is recomputed from its start).
With ``deadline_order`` (``--slo-order``) waiting prompts are admitted by TTFT deadline instead
of arrival (``_next_waiting``), and each step's prompt rows go to the admitted prompts in the same
order (``_in_deadline_order``): earliest deadline first at a chunk's granularity, so a prompt that
arrives behind a long one runs its chunks first where its deadline is sooner (the long one's KV
so far stays; it resumes next step).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection, Iterator, Optional

from scheduling.block_manager import BlockManager
from scheduling.clock import Clock
from scheduling.decode import DecodeConfig, DecodeScheduler
from scheduling.request import Request, Status
from scheduling.step import StepEvents, StepOutput, StepPlan, seq_step


@dataclass(frozen=True)
class HybridConfig:
    token_budget: int = 512  # rows of one step, decodes included (Sarathi's budget)
    min_chunk: int = 16  # prompt tokens a step carries at least while a prompt is admitted
    hand_over: bool = False  # prefill role: a finished prompt waits in finished_prefills
    whole_prompts_when_idle: bool = True  # a step without decodes runs prompts whole (no gap to protect)
    watermark: float = 0.01  # share of the pool a prompt's admission leaves free while others run
    # None: off. N: a step's fixed time in prompt rows (step_s / prefill_token_s); admitted prompts
    # that end within the budget the decodes and N rows leave run first, in a step of their own
    prompt_first_rows: Optional[int] = None
    # admit waiting prompts, and give each step's prompt rows to admitted ones, by TTFT deadline
    # (Request.ttft_deadline), those past it after the rest; requests that have begun (preempted,
    # handed over, migrated) and decodes first, in queue order, as before
    deadline_order: bool = False

    def __post_init__(self):
        if self.token_budget < 1 or self.min_chunk < 1:
            raise ValueError(f"token_budget and min_chunk must be >= 1, got {self}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.prompt_first_rows is not None and self.prompt_first_rows < 0:
            raise ValueError(f"prompt_first_rows must be >= 0, got {self.prompt_first_rows}")


class HybridScheduler(DecodeScheduler):
    """A decode scheduler that also prefills, in chunks within a token budget.

    Besides the decode scheduler's methods: ``release`` / ``keep`` (a finished prompt handed
    over or kept), ``mark_migrating``, ``take_unstarted``, ``finished_prefills``, ``set_hand_over``
    (a flip), ``num_decoding`` and ``num_queued_tokens`` (for placement).
    """

    name = "hybrid"

    def __init__(self, blocks: BlockManager, config: DecodeConfig = DecodeConfig(),
                 hybrid: HybridConfig = HybridConfig(), clock: Optional[Clock] = None):
        super().__init__(blocks, config, clock)
        self.hybrid = hybrid
        self._finished: dict[str, Request] = {}  # KV computed, held here until release or keep
        self._migrating: set[str] = set()  # running requests to hand over after their next token
        self.watermark_blocks = int(hybrid.watermark * blocks.num_blocks)
        self._debt = 0  # rows the last step (prompt-first) took from the budget of this one
        self.num_prompt_first_steps = 0

    def as_sender(self) -> "HybridScheduler":
        return self

    def as_adaptive(self) -> "HybridScheduler":
        return self

    def set_hand_over(self, hand_over: bool, token_budget: Optional[int] = None) -> None:
        """A flip: from now on finished prompts are handed over (prefill role) or kept (decode),
        and steps hold the new role's ``token_budget`` (None: the same)."""
        self.hybrid = replace(self.hybrid, hand_over=hand_over, token_budget=token_budget or self.hybrid.token_budget)

    # --- schedule -------------------------------------------------------------------------
    def _admit(self) -> list[tuple[int, int]]:
        """First come, first served: a request that cannot start for want of blocks stops the
        ones behind it. (The decode scheduler lets later requests that hold their KV pass; here
        new prompts would pass too, and a preempted request could wait for ever behind them.)
        While others run, a request starts only if its blocks leave the watermark free (the
        coupled schedulers' rule, vLLM's ``can_allocate``): without it the running decodes
        soon preempt the newest, and on LPHD ``sim:`` counted 121 preemptions against 96 with it
        (sarathi: 85).

        One exception, or the instance would wait for ever: with nothing running, a head that
        cannot start waits for blocks that only the waiting requests holding their KV (hand-overs
        and moves that landed behind it) can give back, so the first of those that can start
        does. Seen at paper scale (AzureCode, tight TPOT): a preempted 2,017-token request at the
        head needed 127 blocks, 126 were free, and two landed hand-overs behind it held 190."""
        swap_in: list[tuple[int, int]] = []
        while self._waiting and len(self._running) < self.config.max_running:
            request = self._next_waiting()
            keep_free = self.watermark_blocks if self._running else 0
            if self._missing(request) + keep_free > self.blocks.num_free or not (self.admits(request) or not self._running):
                holder = None if self._running else self._kv_holder_that_fits()
                if holder is None:
                    break
                request = holder
            self._start(request, swap_in)
        return swap_in

    def _kv_holder_that_fits(self) -> Optional[Request]:
        """The first waiting request that holds KV blocks and has the blocks to start now."""
        free = self.blocks.num_free
        return next((r for r in self._waiting if r.block_ids and self._missing(r) <= free), None)

    def _next_waiting(self) -> Request:
        """The request admission considers next: the queue's head, or with ``deadline_order``
        (earliest deadline first, an SLO's classic) the first by ``_deadline_rank``. A request that
        cannot start still stops those behind it (no starvation)."""
        if not self.hybrid.deadline_order:
            return self._waiting[0]
        now = self.clock.now()
        return min(enumerate(self._waiting), key=lambda item: _deadline_rank(*item, now))[1]

    def _rows(self) -> tuple:
        """Decodes one row each; prompt chunks share what the budget leaves, in admission order
        (by TTFT deadline with ``deadline_order``: ``_in_deadline_order``).
        With no decode in the step there is no token gap to protect: prompts run whole, as many
        as the budget holds, and one longer than the budget alone (vLLM's prompt step).

        Prompt first (``prompt_first_rows`` N set): admitted prompts that end within the budget
        the decodes and N rows leave run first, whole, in a step of their own, as vLLM's prompt
        step runs them, and the next step's chunks get what the pair leaves of one budget. A
        prompt that would share its last step with D decodes then has its first token D decode
        rows sooner, while the decodes' gap (the two steps) stays within one full step's: the
        token gap the budget was chosen for. Never two prompt-first steps in a row."""
        decodes = sum(_left(r) == 1 for r in self._running)
        whole = self.hybrid.whole_prompts_when_idle and decodes == 0
        left = max(self.hybrid.token_budget - decodes, self.hybrid.min_chunk)
        debt, self._debt = self._debt, 0
        # deadline order matters only where a prompt is running (decode-only steps, the common ones, skip the sort)
        running = self._in_deadline_order() if self.hybrid.deadline_order and decodes < len(self._running) \
            else self._running
        if decodes and not debt and self.hybrid.prompt_first_rows is not None:
            first = self._prompt_first(self.hybrid.token_budget - decodes - self.hybrid.prompt_first_rows, running)
            if first:
                self._debt = sum(_left(r) for r in first) + self.hybrid.prompt_first_rows
                self.num_prompt_first_steps += 1
                return tuple(self._row(r, _left(r)) for r in first)
        if debt and not whole:
            left = max(0, self.hybrid.token_budget - decodes - debt)
        rows = []
        for r in running:
            n = _left(r)
            if whole:  # every running request is a prompt here: whole, while they fit
                if rows and n > left:
                    break
                left -= n
            elif n > 1:  # a prompt (or a recompute): its next chunk, if the budget has room
                n = min(n, left)
                left -= n
                if n <= 0:
                    continue
            rows.append(self._row(r, n))
        return tuple(rows)

    def _in_deadline_order(self) -> list[Request]:
        """The running requests with their prompts by TTFT deadline (EDF at chunk granularity):
        decodes and re-runs first, then prompts still before their deadline, earliest first, then
        those past it, in admission order."""
        now = self.clock.now()
        return [r for _, r in sorted(enumerate(self._running), key=lambda item: _deadline_rank(*item, now))]

    def _prompt_first(self, room: int, running: list[Request]) -> list[Request]:
        """The admitted prompts, in the step's order (``running``: admission order, or by deadline),
        that end within ``room`` rows together."""
        first = []
        for r in running:
            n = _left(r)
            if n > 1:
                if n > room:
                    break
                first.append(r)
                room -= n
        return first

    def _row(self, r: Request, n: int):
        start = r.num_computed_tokens
        r.times.setdefault("scheduled", self.clock.now())  # its first step here: its queue time ends
        return seq_step(r, start, start + n, sample=start + n == r.num_tokens)

    # --- update ---------------------------------------------------------------------------
    def update(self, plan: StepPlan, output: StepOutput) -> StepEvents:
        """The decode scheduler's update; then prompts that just ended (prefill role) and requests
        marked for migration leave the batch for ``finished_prefills`` and are reported there."""
        events = super().update(plan, output)
        now, leaving = self.clock.now(), []
        for request in events.tokens:
            rid = request.request_id
            # its first token: the step ended its prompt, whatever the row's size (a sibling on
            # shared prompt blocks, or a one-token prompt, ends it in a one-token row)
            fresh = request.num_output_tokens == 1
            if fresh:
                request.times["prefill_done"] = now
            if (fresh and self.hybrid.hand_over) or rid in self._migrating:
                self._migrating.discard(rid)
                self._running.remove(request)
                request.status = Status.TRANSFERRING
                self._finished[rid] = request
                leaving.append(request)
        return StepEvents(tokens=events.tokens, prefilled=tuple(leaving))

    # --- leaving and staying --------------------------------------------------------------
    def release(self, request_id: str) -> Request:
        """The KV was handed over: free the request's blocks here and forget it."""
        request = self._finished.pop(request_id)
        del self._requests[request_id]
        self.blocks.free(request.block_ids)
        request.block_ids = []
        return request

    def keep(self, request_id: str) -> None:
        """A finished prompt decodes here after all (the placement found this instance idle)."""
        request = self._finished.pop(request_id)
        request.status = Status.RUNNING
        self._running.append(request)

    def mark_migrating(self, request_ids: Optional[Collection[str]] = None) -> list[str]:
        """Every running decode (those of ``request_ids`` only, if given) leaves after its next
        token (a flip to prefill, or a rebalance, moves them by KV migration); prompts still
        being prefilled stay. Returns the ids marked."""
        ids = [r.request_id for r in self.running_decodes() if request_ids is None or r.request_id in request_ids]
        self._migrating.update(ids)
        return ids

    def running_decodes(self) -> Iterator[Request]:
        """Running requests that take one decode row a step and are not already leaving."""
        return (r for r in self._running if _left(r) == 1 and r.request_id not in self._migrating)

    def unstarted(self) -> Iterator[Request]:
        """The waiting prompts no step has touched (they hold no KV), oldest first; lazily, so a
        caller that wants the first few does not walk a long queue."""
        planned = self._inflight.num_scheduled_tokens if self._inflight is not None else {}
        return (r for r in self._waiting if not r.block_ids and r.num_computed_tokens == 0
                and not r.output_token_ids and r.request_id not in planned)

    def take_unstarted(self, request_ids: Optional[Collection[str]] = None) -> list[Request]:
        """Remove and return the unstarted prompts (those of ``request_ids`` only, if given)."""
        taken = [r for r in self.unstarted() if request_ids is None or r.request_id in request_ids]
        for r in taken:
            self._waiting.remove(r)
            del self._requests[r.request_id]
            r.status = Status.WAITING
        return taken

    @property
    def num_started_tokens(self) -> int:
        """Queued prompt tokens ahead of every unstarted prompt (the running prompts' rest, and
        recomputes)."""
        return self.num_queued_tokens - sum(_left(r) for r in self.unstarted() if _left(r) > 1)

    def _retire(self, request_id: str) -> Request:
        self._migrating.discard(request_id)
        if request_id in self._finished:  # ended while its KV waited for a hand-over
            return self.release(request_id)
        return super()._retire(request_id)

    # --- views ----------------------------------------------------------------------------
    @property
    def finished_prefills(self) -> tuple[Request, ...]:
        return tuple(self._finished.values())

    @property
    def num_decoding(self) -> int:
        """Requests that take a decode row of every step here (running or waiting to)."""
        return sum(_left(r) <= 1 for r in self._running) + sum(bool(r.output_token_ids) for r in self._waiting)

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens (and recomputes) still to compute here."""
        return _prompt_tokens(self._running) + _prompt_tokens(self._waiting)

    @property
    def has_queued_tokens(self) -> bool:
        """``num_queued_tokens > 0``, found at the first prompt (placement asks it every step)."""
        return any(_left(r) > 1 for r in self._running) or any(_left(r) > 1 for r in self._waiting)


def _prompt_tokens(requests) -> int:
    """Tokens the requests with a prompt (or a recompute) to compute still have to go."""
    total = 0
    for r in requests:
        n = r.num_tokens - r.num_computed_tokens
        if n > 1:
            total += n
    return total


def _left(request: Request) -> int:
    """Tokens the request must compute to sample its next token."""
    return request.num_tokens - request.num_computed_tokens


def _deadline_rank(i: int, request: Request, now: float) -> tuple:
    """Where ``request`` (``i``-th in its queue) goes in deadline order: requests that have begun
    (preempted, handed over, migrated), decodes and prompts with no deadline known first, in queue
    order; then prompts still before their TTFT deadline, earliest first; then those past it (they
    miss it however soon they run: the ones that can still meet theirs go first), in queue order."""
    if _left(request) <= 1 or request.output_token_ids or request.ttft_deadline is None:
        return (0, 0.0, i)
    return (2, 0.0, i) if request.ttft_deadline < now else (1, request.ttft_deadline, i)
