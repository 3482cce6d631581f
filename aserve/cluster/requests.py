"""The request table's rows and the events a request's consumer reads."""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Optional

from scheduling.request import Request
from scheduling.step import PromptLogprobs, TokenLogprobs


@dataclass(frozen=True)
class TokenEvent:
    token_id: Optional[int]  # None on a final event that carries no token (abort, error)
    finished: bool = False
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    logprobs: Optional[TokenLogprobs] = None  # the token's, when the request asked (SamplingParams.logprobs)


@dataclass
class RequestHandle:
    """One request's row in the control plane's request table: where it is and its event queue."""

    request: Request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    instance_id: Optional[str] = None
    phase: str = "queued"  # queued | prefill | transfer | decode | done
    aborted: bool = False
    token_times: list = field(default_factory=list)
    prefill_instance: Optional[str] = None
    decode_instance: Optional[str] = None
    epoch: int = 0  # bumped when the request is re-run elsewhere: stale handoffs see it and stop
    # False: the queue carries only the final event; each token's time is still in token_times (a
    # replay on a simulated device: millions of tokens, and a wake-up of the consumer for each cost
    # a tenth of the run)
    stream_tokens: bool = True
    # echo (SamplingParams.prompt_logprobs): entry i is the prompt token at position i + 1's; all
    # of them are here before the first token's event (the step that samples it scores the last rows)
    prompt_logprobs: list = field(default_factory=list)

    def add_prompt_logprobs(self, got: PromptLogprobs) -> None:
        """Take a step's scored prompt rows; rows scored again (a prompt recomputed after a
        preemption) are the same numbers: the first ones stay."""
        have = len(self.prompt_logprobs) + 1  # the next position wanted
        assert got.first_pos <= have, f"prompt logprobs skip positions {have}..{got.first_pos - 1}"
        self.prompt_logprobs.extend(got.entries[have - got.first_pos:])


class EventLog:
    """What the monitor shows as events: flips, failures, re-runs, retries, rejections. Every
    part of the control plane writes to the one log; each keeps its own counters."""

    def __init__(self, maxlen: int = 500):
        self.events: collections.deque = collections.deque(maxlen=maxlen)

    def log(self, kind: str, instance: Optional[str], message: str) -> None:
        self.events.append({"time": time.time(), "kind": kind, "instance": instance, "message": message})
