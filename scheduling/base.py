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

Beyond the contract, a scheduler may play a part in a KV hand-over, each a small protocol it
answers for itself (``as_sender``, ``as_receiver``, ``as_adaptive``: itself, or None where it
plays no such part), so the instance and the control plane never ask which class it is::

    KVSender     prompts whose KV leaves (prefill, adaptive): take_unstarted, release
    KVReceiver   KV that arrives (decode, adaptive): allocate_incoming ... accept_incoming, load
    Adaptive     both, plus keep / mark_migrating / set_hand_over (scheduling/hybrid.py)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Collection, Iterator, Optional, Protocol

from scheduling.block_manager import BlockManager
from scheduling.clock import Clock, MonotonicClock
from scheduling.request import Request
from scheduling.step import StepEvents, StepOutput, StepPlan

if TYPE_CHECKING:
    from scheduling.dispatch import DecodeLoad


class KVSender(Protocol):
    """A scheduler whose prompts' KV may leave it: a drain hands its untouched requests on, a
    finished prompt's blocks are freed once its KV is handed over."""

    def take_unstarted(self, request_ids: Optional[Collection[str]] = None) -> list[Request]:
        """Remove and return queued requests no step has touched (all, or those of ``request_ids``)."""

    def release(self, request_id: str) -> Request:
        """The KV was handed over: free the request's blocks here and forget it."""


class KVReceiver(Protocol):
    """A scheduler that takes KV handed over from another instance."""

    incoming_ids: Collection[str]  # requests whose KV is on its way into reserved blocks

    def allocate_incoming(self, request: Request) -> Optional[list[int]]:
        """Blocks for ``request``'s KV before it is sent; None: not now."""

    def incoming_room(self) -> int:
        """Blocks a hand-over may reserve now (-1: none)."""

    def accept_incoming(self, request: Request) -> None:
        """The KV arrived in the reserved blocks: the request joins the queue."""

    def reclaim_incoming(self, lease_s: float, keep) -> list[str]:
        """Free reservations older than ``lease_s`` whose KV never came."""

    def load(self, instance_id: str) -> "DecodeLoad":
        """This instance's load as the dispatchers read it."""


class Adaptive(KVSender, KVReceiver, Protocol):
    """Adaptive mode's scheduler: prompts and decodes on one instance, a prefilled request kept
    or handed over, running decodes moved out by KV migration."""

    def set_hand_over(self, hand_over: bool, token_budget: Optional[int] = None) -> None: ...

    def keep(self, request_id: str) -> None: ...

    def mark_migrating(self, request_ids: Optional[Collection[str]] = None) -> list[str]: ...

    def running_decodes(self) -> Iterator[Request]: ...

    def unstarted(self) -> Iterator[Request]: ...

    @property
    def num_decoding(self) -> int: ...

    @property
    def num_started_tokens(self) -> int: ...

    @property
    def has_queued_tokens(self) -> bool: ...


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

    def kv_outlook(self, expected_output_tokens: int, floor: Optional[int] = None) -> int:
        """KV blocks a new prompt would find here while the requests already here decode (a
        role whose requests do not grow here: the blocks free now), at least ``floor``."""
        return self.blocks.num_free if floor is None else max(self.blocks.num_free, floor)

    # ---- the parts a scheduler may play in a hand-over (module doc); none by default ----------
    def as_sender(self) -> Optional[KVSender]:
        return None

    def as_receiver(self) -> Optional[KVReceiver]:
        return None

    def as_adaptive(self) -> Optional[Adaptive]:
        return None
