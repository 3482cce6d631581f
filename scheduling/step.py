"""One step in the schedulers' words: the plan a device executes, and what comes back.

    Scheduler.schedule() ──StepPlan──► Device.execute(plan) ──StepOutput──► Scheduler.update(plan, out)
                                                                                │
                                                        StepEvents (tokens, prompts prefilled) ◄┘

A plan is immutable and is everything a device needs: it never sees a ``Request`` or a block
manager. Its rows, in the order the device lays them out::

    | prompt chunks and recomputes (> 1 token) | decode rows (1 token) | pad x num_pad_tokens |

Every role speaks it: a prefill chunk, a decode batch, a coupled hybrid batch and ALISE's
swap-only steps are all ``StepPlan``s; they differ in which rows they hold, not in type.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional

from scheduling.request import Request, SamplingParams


@dataclass(frozen=True)
class SeqStep:
    """One request's tokens in a step: ``token_ids`` sit at positions ``start_pos ...``."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]  # the request's blocks, covering start_pos + len(token_ids)
    sampling: Optional[SamplingParams] = None  # None: no token is sampled (a prompt chunk mid-prompt)
    num_output_tokens: int = 0  # tokens it has already: a seeded request draws step i from (seed, i)
    tap: bool = False  # return this sequence's last token's features (StepPlan.tap_layer)
    # Log-probabilities, computed only where a row asks (no log-softmax over the vocabulary else):
    num_logprobs: Optional[int] = None  # sampled row: its token's logprob and this many top ones
    prompt_targets: tuple[int, ...] = ()  # echo: row i scores prompt_targets[i], the prompt token after it
    num_prompt_logprobs: int = 0  # top ones for each of those rows

    def __post_init__(self):
        assert len(self.prompt_targets) <= len(self.token_ids), "one scored prompt token a row at most"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """What one step computes and moves. ``swap_out`` pairs are (device block, host block) and are
    copied before ``swap_in`` pairs (host block, device block): a block freed by a swap-out may be
    reused by a swap-in of the same step."""

    seqs: tuple[SeqStep, ...] = ()
    num_pad_tokens: int = 0  # TetriInfer's fixed-size chunks: padding computed, then thrown away
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    preempted_ids: tuple[str, ...] = ()  # requests this step's scheduling preempted (bookkeeping only)
    tap_layer: int = 0  # > 0: the tapped sequences' last-token hidden states after this many layers
    want_logits: bool = False  # return the sampled rows' logits too (tests, parity checks)
    kv_decisions: tuple = ()  # ALISE: what happened to each parked job's KV, and why (logs, tests)

    def __post_init__(self):
        assert len({s.request_id for s in self.seqs}) == len(self.seqs), "one SeqStep a request"
        assert self.num_pad_tokens >= 0

    @property
    def empty(self) -> bool:
        """Nothing to compute, move or account for: the instance idles instead."""
        return not (self.seqs or self.swap_out or self.swap_in or self.preempted_ids)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """``{request_id: num_tokens}`` in row order: how far each request moves this step."""
        return {s.request_id: s.num_tokens for s in self.seqs}

    @property
    def num_real_tokens(self) -> int:
        """Tokens of requests (padding excluded)."""
        return sum(s.num_tokens for s in self.seqs)

    @property
    def sampled_ids(self) -> tuple[str, ...]:
        """Requests that get a token from this step (their prompt, or recompute, is caught up)."""
        return tuple(s.request_id for s in self.seqs if s.sampling is not None)

    @property
    def block_ids(self) -> Mapping[str, tuple[int, ...]]:
        return MappingProxyType({s.request_id: s.block_ids for s in self.seqs})


EMPTY_PLAN = StepPlan()
GREEDY = SamplingParams(temperature=0.0)  # sample the arg-max (benchmarks, tests)


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities: ``token_id``'s own and the ``top`` most likely tokens,
    ``(token id, logprob)`` most likely first. Plain numbers: they leave the device's thread."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """A step's scored prompt rows (echo): ``entries[i]`` is for the prompt token at position
    ``first_pos + i`` (position 0 has none: nothing precedes it)."""

    first_pos: int
    entries: tuple[TokenLogprobs, ...]


@dataclass(frozen=True)
class StepOutput:
    """What a device returns. ``logits`` and ``features`` hold the device's tensors, opaque here."""

    sampled: Mapping[str, int]
    num_tokens: int = 0  # rows computed, padding included
    forward_s: float = 0.0  # the forward alone, on the device's own clock
    busy_s: float = 0.0  # how long the step held the device (an emulated device's time, when slower)
    logits: Optional[Mapping[str, Any]] = None
    features: Optional[Mapping[str, Any]] = None  # tapped request -> float32 [hidden]
    logprobs: Optional[Mapping[str, TokenLogprobs]] = None  # sampled rows that asked (num_logprobs)
    prompt_logprobs: Optional[Mapping[str, PromptLogprobs]] = None  # rows with prompt_targets


@dataclass(frozen=True)
class StepEvents:
    """What ``update`` changed that the instance must act on."""

    tokens: tuple[Request, ...] = ()  # got a token this step: the last of their output_token_ids
    prefilled: tuple[Request, ...] = ()  # prompt done here, KV held for a hand-over (prefill role)


def seq_step(req: Request, start: int, end: int, sample: bool, tap: bool = False) -> SeqStep:
    """``req``'s tokens ``[start, end)`` as a ``SeqStep`` over its current blocks."""
    sp = req.sampling
    return SeqStep(req.request_id, tuple(req.token_ids_slice(start, end)), start, tuple(req.block_ids),
                   sp if sample else None, req.num_output_tokens, tap,
                   num_logprobs=sp.logprobs if sample else None, prompt_targets=prompt_targets(req, start, end),
                   num_prompt_logprobs=sp.prompt_logprobs or 0)


def prompt_targets(req: Request, start: int, end: int) -> tuple[int, ...]:
    """Echo: the prompt tokens that rows ``[start, end)`` predict (row i: the token at i + 1).

    Asked until the request samples its first token: the step that samples it is the one that
    scores the prompt's last rows, so a recompute after that asks nothing again. A recompute
    before it (a prompt preempted mid-way) asks again; the host keeps the first it got."""
    if req.sampling.prompt_logprobs is None or req.output_token_ids:
        return ()
    return tuple(req.prompt_token_ids[start + 1:min(end + 1, req.num_prompt_tokens)])
