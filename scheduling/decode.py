"""The decode instance's local scheduler: continuous batching with admission policies (§3.4).

Life of a request here::

    allocate_incoming ─KV copy─► accept_incoming ─► waiting ─admit─► running ─► finish
    add_request (KV lost elsewhere) ───────────────────►  ▲                │
                                                          └─── preempt ────┘  (recompute | swap)

Every running request advances one token per step: it enters a step with ``num_computed_tokens
== num_tokens - 1`` (the last sampled token's KV is not in the cache yet) and leaves it caught
up, plus one sampled token. A recomputed request (blocks freed, ``num_computed_tokens = 0``)
comes back as one prefill of prompt + output in a single step; a swapped one gets new device
blocks and the runner copies its KV back from host.

The policies differ only in ``admits``: ``greedy`` (vLLM: admit while blocks are free),
``reserve-static`` and ``reserve-dynamic`` (admit from predicted lengths, TetriInfer §3.4).
Both reserve policies use ``live_max_output``: the safe upper bound of a prediction
(``predicted_max_output``) until the request outlives it, then ``max_tokens``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Container, Hashable, Optional

from scheduling.base import Scheduler
from scheduling.block_manager import BlockManager, blocks_needed
from scheduling.clock import Clock
from scheduling.prefix import publish_prefix, share_prefix
from scheduling.dispatch import DecodeLoad, is_heavy, predicted_max_output
from scheduling.request import Request, Status
from scheduling.step import EMPTY_PLAN, StepEvents, StepOutput, StepPlan, seq_step

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class DecodeConfig:
    max_running: int = 256  # batch size cap
    preemption: str = "recompute"  # recompute | swap
    num_swap_blocks: int = 0  # host blocks for swap; when they run out, swap recomputes
    heavy_threshold: int = 128  # for load(): heavy decodes, as dispatch counts them

    def __post_init__(self):
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.max_running < 1 or self.num_swap_blocks < 0:
            raise ValueError(f"bad decode config {self}")


class DecodeScheduler(Scheduler):
    """Greedy admission (vLLM); subclasses override ``admits``.

    Besides the contract: ``allocate_incoming`` / ``accept_incoming`` (a KV hand-over),
    ``reclaim_incoming``, ``load``, ``running_ids`` / ``waiting_ids`` / ``swapped_ids`` /
    ``incoming_ids``.
    """

    name = "greedy"
    role = "decode"

    def __init__(self, blocks: BlockManager, config: DecodeConfig = DecodeConfig(),
                 clock: Optional[Clock] = None):
        super().__init__(blocks, clock)
        self.config = config
        self.host = BlockManager(max(1, config.num_swap_blocks), blocks.block_size)
        self._requests: dict[str, Request] = {}
        self._incoming: dict[str, list[int]] = {}  # blocks reserved for KV still on the wire
        self._incoming_at: dict[str, float] = {}  # when each reservation was made (the lease)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order: the newest is preempted first
        self._swapped: dict[str, list[int]] = {}  # host blocks of swapped-out requests
        self._inflight: Optional[StepPlan] = None
        self.num_forced_admissions = 0  # admitted against the policy into an empty batch

    def as_receiver(self) -> "DecodeScheduler":
        return self

    # --- arrival --------------------------------------------------------------------------
    def allocate_incoming(self, request: Request) -> Optional[list[int]]:
        """Blocks for the request's prompt KV before it is sent; None means "not now", retry later.

        Refused while a preempted request waits for blocks (it must not starve behind new
        arrivals) and when the blocks would eat into what the policy reserves for the batch.
        ``request.block_ids`` is left alone (the prefill side still owns it until it releases);
        ``accept_incoming`` attaches these blocks once the KV has arrived.
        """
        assert request.request_id not in self._requests, f"duplicate {request.request_id}"
        n = blocks_needed(request.num_computed_tokens, self.blocks.block_size)
        if n > self.incoming_room():
            return None
        self._requests[request.request_id] = request
        self._incoming[request.request_id] = self.blocks.allocate(n)
        self._incoming_at[request.request_id] = self.clock.now()
        return list(self._incoming[request.request_id])

    def incoming_room(self) -> int:
        """Blocks a hand-over may reserve now (``allocate_incoming`` takes a request whose KV fits
        in them): -1 while a preempted request waits for blocks, else the free blocks less what
        the policy reserves for the batch."""
        if any(not r.block_ids for r in self._waiting):
            return -1
        return self.blocks.num_free - self.reserved_blocks()

    def accept_incoming(self, request: Request) -> None:
        """The prompt KV has fully arrived; the request carries its first sampled token."""
        request.block_ids = self._incoming.pop(request.request_id)
        self._incoming_at.pop(request.request_id, None)
        # a prefilled prompt, or a migrated decode: all but the last sampled token are in the KV
        assert request.num_computed_tokens == request.num_tokens - 1 and request.output_token_ids
        publish_prefix(self.blocks, request, 0)  # its full blocks are computed KV: a later turn may start on them
        request.status = Status.WAITING
        self._waiting.append(request)

    def add_request(self, request: Request) -> None:
        """Take over a request whose KV was lost on another instance (it failed): it waits like a
        recompute-preempted request, and its first step here recomputes prompt + output (the
        output streamed so far is kept, so generation goes on where it stopped)."""
        assert request.request_id not in self._requests, f"duplicate {request.request_id}"
        assert not request.block_ids and request.num_computed_tokens == 0, request.request_id
        request.status = Status.PREEMPTED
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def reclaim_incoming(self, lease_s: float, keep: Container[str] = ()) -> list[str]:
        """Free reservations older than ``lease_s`` whose KV never arrived (the sender died or
        its handoff was lost); ``keep`` holds (``in``) transfers the caller knows are still
        moving, and is asked only about the stale ones. Returns the reclaimed request ids."""
        cutoff = self.clock.now() - lease_s
        stale = [rid for rid, t in self._incoming_at.items() if t <= cutoff and rid not in keep]
        for rid in stale:
            self._retire(rid)
        return stale

    @property
    def incoming_ids(self) -> list[str]:
        return list(self._incoming)

    # --- policy hooks ---------------------------------------------------------------------
    def reserved_blocks(self) -> int:
        """Free blocks the policy keeps for the running batch's growth. Greedy: none."""
        return 0

    def admits(self, request: Request) -> bool:
        """Whether the policy lets ``request`` join the batch now (blocks for its next step are
        checked separately). Greedy: always."""
        return True

    # --- schedule -------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Grow running requests (preempting the newest when blocks run out), then admit."""
        assert self._inflight is None, "update with the previous step first"
        preempted: list[str] = []
        swap_out: list[tuple[int, int]] = []
        for request in list(self._running):
            if request.request_id not in preempted:
                self._grow_or_preempt(request, preempted, swap_out)
        swap_in = [] if preempted else self._admit()  # no churn: nothing joins a step that preempts
        plan = StepPlan(self._rows(), swap_out=tuple(swap_out), swap_in=tuple(swap_in), preempted_ids=tuple(preempted))
        if plan.empty:
            return EMPTY_PLAN
        self._inflight = plan
        return plan

    def _rows(self) -> tuple:
        """The step's rows: every running request catches up to its last token and samples the next."""
        return tuple(seq_step(r, r.num_computed_tokens, r.num_tokens, sample=True) for r in self._running)

    def _grow_or_preempt(self, request: Request, preempted: list, swap_out: list) -> None:
        while True:
            if self._missing(request) <= self.blocks.num_free:
                self.blocks.grow(request.block_ids, request.num_tokens)
                return
            victim = self._running[-1]
            self._preempt(victim, swap_out)
            preempted.append(victim.request_id)
            if victim is request:
                return

    def _preempt(self, request: Request, swap_out: list) -> None:
        self._running.remove(request)
        request.status = Status.PREEMPTED
        request.num_preemptions += 1
        n = len(request.block_ids)
        swap = self.config.preemption == "swap" and self.config.num_swap_blocks > 0
        if swap and self.host.can_allocate(n):
            host_ids = self.host.allocate(n)
            swap_out.extend(zip(request.block_ids, host_ids))
            self._swapped[request.request_id] = host_ids
        else:
            request.num_computed_tokens = 0  # the KV is gone: prompt + output run again
        self.blocks.free(request.block_ids)
        request.block_ids = []
        self._waiting.appendleft(request)  # newest preempted first, so the oldest ends in front

    def _missing(self, request: Request) -> int:
        """Blocks the request lacks for computing up to its last token (swapped: all of them)."""
        return blocks_needed(request.num_tokens, self.blocks.block_size) - len(request.block_ids)

    def _admit(self) -> list[tuple[int, int]]:
        """Admit in queue order. Requests that cannot start now (no blocks) let those holding
        their KV go first; a request the policy refuses blocks everyone behind it (no
        starvation), except in an empty batch. An empty batch that the policy would leave
        empty takes the first request that can start: the batch must make progress."""
        swap_in: list[tuple[int, int]] = []
        for request in list(self._waiting):
            if len(self._running) >= self.config.max_running:
                break
            if self._missing(request) > self.blocks.num_free:
                continue
            if self.admits(request):
                self._start(request, swap_in)
            elif self._running:
                break
        if not self._running:
            free = self.blocks.num_free
            first = next((r for r in self._waiting if self._missing(r) <= free), None)
            if first is not None:
                self.num_forced_admissions += 1
                self._start(first, swap_in)
        return swap_in

    def _start(self, request: Request, swap_in: list) -> None:
        self._waiting.remove(request)
        host_ids = self._swapped.pop(request.request_id, None)
        if host_ids is not None:
            request.block_ids = self.blocks.allocate(len(host_ids))
            swap_in.extend(zip(host_ids, request.block_ids))
            self.host.free(host_ids)
        else:
            share_prefix(self.blocks, request)  # a sibling's prompt blocks, if published here
        self.blocks.grow(request.block_ids, request.num_tokens)
        request.status = Status.RUNNING
        self._running.append(request)

    # --- update ---------------------------------------------------------------------------
    def update(self, plan: StepPlan, output: StepOutput) -> StepEvents:
        """The step ran: catch every scheduled request up and append its sampled token. The
        instance applies the stop rules to ``StepEvents.tokens`` and ``finish``es the done ones."""
        assert plan is self._inflight, "update with the plan that is in flight"
        self._inflight = None
        now, got = self.clock.now(), []
        for s in plan.seqs:
            request = self._requests.get(s.request_id)
            if request is None:
                continue  # aborted while the step ran
            assert request.num_computed_tokens == s.start_pos
            request.num_computed_tokens = s.end_pos
            publish_prefix(self.blocks, request, s.start_pos)
            if s.request_id not in output.sampled:
                continue  # a prompt chunk short of its end (a hybrid step, scheduling/hybrid.py)
            assert request.num_computed_tokens == request.num_tokens, s.request_id
            request.output_token_ids.append(output.sampled[s.request_id])
            request.token_times.append(now)
            got.append(request)
        return StepEvents(tokens=tuple(got))

    def finish(self, request: Request, reason: str) -> None:
        self._retire(request.request_id)
        request.status, request.finish_reason = Status.FINISHED, reason

    def abort(self, request_id: str) -> Optional[Request]:
        """Drop the request wherever it is (incoming, waiting, running, swapped) and free all."""
        if request_id not in self._requests:
            return None
        request = self._retire(request_id)
        request.status = Status.FINISHED
        request.finish_reason = "abort"
        return request

    def _retire(self, request_id: str) -> Request:
        request = self._requests.pop(request_id)
        self._incoming_at.pop(request_id, None)
        incoming = self._incoming.pop(request_id, None)
        if incoming is not None:  # its block_ids are still the sender's: not ours to free
            self.blocks.free(incoming)
            return request
        self.host.free(self._swapped.pop(request_id, []))
        self._waiting = deque(r for r in self._waiting if r.request_id != request_id)
        self._running = [r for r in self._running if r.request_id != request_id]
        self.blocks.free(request.block_ids)
        request.block_ids = []
        return request

    # --- views ----------------------------------------------------------------------------
    def load(self, instance_id: Hashable) -> DecodeLoad:
        """This instance's load for the cluster monitor's broadcast."""
        heavy = sum(is_heavy(r, self.config.heavy_threshold) for r in self._requests.values())
        return DecodeLoad(instance_id, self.blocks.num_free, self.blocks.num_blocks,
                          heavy, len(self._requests) - heavy, self.blocks.block_size)

    @property
    def running_ids(self) -> list[str]:
        return [r.request_id for r in self._running]

    @property
    def waiting_ids(self) -> list[str]:
        return [r.request_id for r in self._waiting]

    @property
    def swapped_ids(self) -> list[str]:
        return list(self._swapped)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def queue_lengths(self) -> tuple[int, int]:
        """Waiting includes preempted requests; requests whose KV is still arriving are not counted."""
        return len(self._waiting), len(self._running)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)


def _blocks_at(request: Request, num_tokens: int, block_size: int) -> int:
    """Blocks the request holds once it has ``num_tokens`` tokens, never fewer than it holds."""
    return max(len(request.block_ids), blocks_needed(num_tokens, block_size))


def live_max_output(request: Request) -> int:
    """The output bound a reservation holds a running request to: the prediction's safe bound
    (``predicted_max_output``) while the request may still end within it; once the request has
    that many output tokens and is still running, the prediction is refuted and ``max_tokens``
    is the only bound left, as for a request never predicted.

    Holding an overrun request to its spent prediction would leave it one step to go for as long
    as it runs: reserve-dynamic's shortest job would be one step away, so the instance would admit
    as greedily as ``greedy`` until that request ends. Measured (docs/notes/predictors.md, issue 25):
    held to the spent bound, the backends kept 122-181 of greedy's ~186 preemptions a replay where
    the oracle, never overrun, kept 11-26; held to ``max_tokens``, 13-50, and the best backend's
    share of the oracle's JCT gain went from 21-29% to 113%.
    """
    bound = predicted_max_output(request)
    if request.predicted is not None and request.num_output_tokens >= bound:
        return max(1, request.sampling.max_tokens)
    return bound


def predicted_growth(request: Request, block_size: int) -> int:
    """Blocks the request is predicted to still need: prompt + live output bound, minus held,
    and at least its next step's blocks."""
    total = max(blocks_needed(request.num_prompt_tokens + live_max_output(request), block_size),
                blocks_needed(request.num_tokens, block_size))
    return max(0, total - len(request.block_ids))


def predicted_remaining(request: Request) -> int:
    """Output tokens the request is predicted to still generate (at least one)."""
    return max(1, live_max_output(request) - request.num_output_tokens)


class ReserveStaticDecodeScheduler(DecodeScheduler):
    """Reserve every running request's predicted growth; admit a request only if its own
    predicted total fits what is left. With right predictions, nothing is ever preempted."""

    name = "reserve-static"

    def reserved_blocks(self) -> int:
        return sum(predicted_growth(r, self.blocks.block_size) for r in self._running)

    def admits(self, request: Request) -> bool:
        need = predicted_growth(request, self.blocks.block_size)
        return need <= self.blocks.num_free - self.reserved_blocks()


class ReserveDynamicDecodeScheduler(DecodeScheduler):
    """Admit a request only if memory lasts until the shortest predicted job of the batch (the
    request included) finishes: until then everyone grows that many tokens, then blocks return."""

    name = "reserve-dynamic"

    def reserved_blocks(self) -> int:
        return _need_until_shortest(self._running, self.blocks.block_size)

    def admits(self, request: Request) -> bool:
        need = _need_until_shortest(self._running + [request], self.blocks.block_size)
        return need <= self.blocks.num_free


def _need_until_shortest(batch: list[Request], block_size: int) -> int:
    """Blocks the batch grows by until its shortest predicted job finishes."""
    if not batch:
        return 0
    steps = min(predicted_remaining(r) for r in batch)
    return sum(_blocks_at(r, min(r.num_tokens + steps, r.max_total_tokens()), block_size)
               - len(r.block_ids) for r in batch)
