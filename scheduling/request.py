"""Request bookkeeping shared by every scheduler, the runner and the cluster.

A request is "caught up" when ``num_computed_tokens == num_tokens``: prefill, chunked prefill,
recompute after preemption and decode are all steps that move ``num_computed_tokens`` towards
``num_tokens`` (vLLM v1's idea). Only the event-loop thread mutates a ``Request``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # benchmark replays: end with "length" after exactly this many tokens. Unlike max_tokens it
    # is no bound that schedulers, reservations or predictors read, so a replay that must
    # generate a trace's length does not hand every policy the true length for free
    length_after: Optional[int] = None
    # log-probabilities (the model's own, before temperature and top-p), as vLLM names them:
    # ``logprobs`` k >= 0: each sampled token's and the k most likely; ``prompt_logprobs`` k >= 0:
    # every prompt token's (the first has none) and the k most likely (echo). None: not computed.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.length_after is not None and not 1 <= self.length_after <= self.max_tokens:
            raise ValueError(f"length_after must be in [1, max_tokens={self.max_tokens}], got {self.length_after!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or k < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class LengthRange:
    """A predicted output length: the bucket ``[lo, hi)`` and its probability."""

    lo: int
    hi: int
    bucket: int = 0
    prob: float = 1.0

    def __post_init__(self):
        assert 0 <= self.lo < self.hi, (self.lo, self.hi)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    TRANSFERRING = "transferring"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request and everything the schedulers track about it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    prompt_text: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None  # stop | length | abort | error
    error: Optional[str] = None
    predicted: Optional[LengthRange] = None
    # requests of one group have the same prompt (the n choices of one API prompt): they share the
    # KV blocks of its prompt instead of computing it each (scheduling/prefix.py); None: no sharing
    prefix_group: Optional[str] = None
    # automatic prefix caching (scheduling/prefix.py): blocks are shared only between requests of
    # one salt (vLLM's ``cache_salt``: a tenant cannot probe another's cache); None is a salt too
    cache_salt: Optional[str] = None
    num_cached_tokens: Optional[int] = None  # prompt tokens its prefill found cached (None: not looked up)
    # prompt tokens the instance it queued at held cached as it joined the queue (prefix.note_cached):
    # until it starts, that queue's work counts only the rest (prefix.uncached_left)
    cached_hint: int = 0
    block_hashes: list = field(default_factory=list, repr=False)  # prefix_keys' memo: [root, key0, key1 ...]
    # > 0: the length predictor reads the prompt's last-token hidden state after this many layers
    # from this request's own prefill (aserve/predict/online.py, "prefill features")
    feature_layer: int = 0
    num_preemptions: int = 0
    # clock seconds by which its first token meets the TTFT SLO in force (adaptive placement sets it;
    # an instance with deadline order admits prompts by it: scheduling/hybrid.py); None: none known
    ttft_deadline: Optional[float] = None
    # timestamps (clock seconds): scheduled, first_token, finish; token_times has one per output token
    times: dict = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError("prompt must have at least one token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while the prompt (or a recompute of prompt + output) is not yet fully in the cache."""
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_id_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def max_total_tokens(self) -> int:
        """Upper bound of prompt + output tokens this request can reach."""
        return self.num_prompt_tokens + self.sampling.max_tokens
