"""The one scheduler contract every role and policy keeps (vLLM v1 style).

    add_request(req)          a request enters this instance's queues
    schedule() -> StepPlan    the next step, blocks allocated; an empty plan: nothing can run now
    update(plan, output)      the step ran: progress, sampled tokens -> StepEvents
    finish(req, reason)       the instance's stop check ended ``req`` (its last token is in): free it
    abort(request_id)         drop it wherever it is and free its blocks

One plan is in flight at a time: ``update`` takes the plan ``schedule`` returned last. Every
step moves some requests' ``num_computed_tokens`` towards ``num_tokens``; roles differ in which
requests they hold and policies in ordering and budget. Stop rules are not the scheduler's: the
instance applies them to ``StepEvents.tokens`` and calls ``finish``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

from scheduling.block_manager import BlockManager
from scheduling.clock import Clock, MonotonicClock
from scheduling.request import Request
from scheduling.step import StepEvents, StepOutput, StepPlan


class Scheduler(ABC):
    """An instance's local scheduler. ``role`` is the instance role it serves; ``name`` the
    policy name the registry knows it by."""

    name: ClassVar[str]
    role: ClassVar[str]  # prefill | decode | coupled

    def __init__(self, blocks: BlockManager, clock: Optional[Clock] = None):
        self.blocks = blocks
        self.clock = clock or MonotonicClock()

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """A request enters this instance (prefill, coupled: a new prompt; decode: a request
        whose KV is lost elsewhere, recomputed here)."""

    @abstractmethod
    def schedule(self) -> StepPlan:
        """Plan the next step and allocate its blocks; ``EMPTY_PLAN`` when nothing can run."""

    @abstractmethod
    def update(self, plan: StepPlan, output: StepOutput) -> StepEvents:
        """Apply a step's results: progress of every scheduled request, sampled tokens."""

    @abstractmethod
    def finish(self, request: Request, reason: str) -> None:
        """End ``request`` (stop or length; its last token is in) and free its blocks here."""

    @abstractmethod
    def abort(self, request_id: str) -> Optional[Request]:
        """Drop the request wherever it is and free its blocks; None if it is not here."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while a request waits for or is in a step."""

    @property
    @abstractmethod
    def num_requests(self) -> int:
        """Requests this instance holds, in any state (a drained instance holds none)."""

    @abstractmethod
    def queue_lengths(self) -> tuple[int, int]:
        """(waiting, running) in the role's own terms, for metrics and the monitor."""

    @property
    def num_queued_tokens(self) -> int:
        """Load for the global scheduler: prompt tokens waiting here."""
        return 0
