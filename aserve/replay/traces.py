"""Request traces: read any supported format, then fit it to this run.

    file ──read_trace (aserve/replay/trace_formats.py)──► RawTrace [TraceRequest(arrival_s, prompt_tokens, output_tokens)]
                              │ fit(FitOptions): select, re-time, rescale, clip to the context
                              ▼
                    Trace(requests, format, changes, clipped)  ──► replay; the report prints ``changes``

Formats: Azure 2023 CSV, length-only CSV (ShareGPT / arXiv tables), Mooncake JSONL and the
project's own JSONL (traces/README.md). Fitting never reorders requests.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional

from aserve.replay.trace_formats import (RawTrace, TraceError, TraceRequest, detect_format, parse_azure_time,  # noqa: F401
                                  read_trace)

# ---- fitting -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FitOptions:
    """How to fit a trace to this run: which requests, how fast, how long, the model's context.

    ``time_scale`` multiplies every arrival time (0.5 = twice as fast); ``rate`` rescales a timed
    trace to that mean request rate, or draws arrivals for an untimed one: Gamma inter-arrival
    times of mean ``1/rate`` and shape ``burstiness`` (1 = Poisson, < 1 burstier, > 1 smoother).
    """

    num_requests: Optional[int] = None
    time_scale: float = 1.0
    rate: Optional[float] = None
    burstiness: float = 1.0
    max_prompt_tokens: Optional[int] = None
    max_output_tokens: Optional[int] = None
    length_scale: float = 1.0
    context_window: Optional[int] = None
    seed: int = 0

    def __post_init__(self):
        for name in ("num_requests", "max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        for name in ("time_scale", "burstiness", "length_scale"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate!r}")
        if self.rate is not None and self.time_scale != 1.0:
            raise ValueError("give --rate or --time-scale, not both")
        if self.context_window is not None and self.context_window < 2:
            raise ValueError(f"context_window must be >= 2, got {self.context_window!r}")


@dataclass(frozen=True)
class Trace:
    """A fitted trace: the requests to replay and what fitting changed (for the report)."""

    requests: tuple[TraceRequest, ...]
    source: str
    format: str
    changes: tuple[str, ...] = ()
    clipped: frozenset = frozenset()  # indices of requests whose lengths were cut

    @property
    def num_clipped(self) -> int:
        return len(self.clipped)

    @property
    def longest_context(self) -> Optional[int]:
        """The longest prompt + output a request reaches (None for an empty trace)."""
        return max((r.prompt_tokens + r.output_tokens for r in self.requests), default=None)

    def summary(self) -> dict:
        reqs = self.requests
        return {"source": self.source, "format": self.format, "num_requests": len(reqs),
                "duration_s": reqs[-1].arrival_s if reqs else 0.0,
                "prompt_tokens": sum(r.prompt_tokens for r in reqs),
                "output_tokens": sum(r.output_tokens for r in reqs),
                "num_clipped": self.num_clipped, "changes": list(self.changes)}


def gamma_arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` arrival times from 0: Gamma gaps of mean ``1/rate`` and shape ``burstiness``."""
    rng, times, t = random.Random(seed), [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def _arrivals(raw: RawTrace, reqs: list[TraceRequest], opts: FitOptions, changes: list[str]) -> list[float]:
    times = [r.arrival_s for r in reqs]
    if not raw.timed:
        if opts.rate is None:
            changes.append("no arrival times and no --rate: every request arrives at t=0")
            return times
        kind = "Poisson" if opts.burstiness == 1.0 else f"Gamma (burstiness {opts.burstiness:g})"
        changes.append(f"arrivals drawn: {kind} at {opts.rate:g} req/s, seed {opts.seed}")
        return gamma_arrivals(len(reqs), opts.rate, opts.burstiness, opts.seed)
    if opts.burstiness != 1.0:
        raise ValueError("--burstiness applies only to traces without arrival times")
    if opts.time_scale != 1.0:
        changes.append(f"arrival times scaled x{opts.time_scale:g} (all {len(times)} requests)")
        return [t * opts.time_scale for t in times]
    if opts.rate is not None and len(times) > 1 and times[-1] > 0:
        observed = (len(times) - 1) / times[-1]
        factor = observed / opts.rate
        changes.append(f"arrivals rescaled x{factor:.3g}: {observed:.3g} -> {opts.rate:g} req/s")
        return [t * factor for t in times]
    return times


def _clip(p: int, o: int, opts: FitOptions, hits: dict) -> tuple[int, int]:
    """Apply the length limits to one request, counting which ones bit."""
    if opts.max_prompt_tokens is not None and p > opts.max_prompt_tokens:
        p, hits["max_prompt"] = opts.max_prompt_tokens, hits["max_prompt"] + 1
    if opts.max_output_tokens is not None and o > opts.max_output_tokens:
        o, hits["max_output"] = opts.max_output_tokens, hits["max_output"] + 1
    ctx = opts.context_window
    if ctx is not None and p + o > ctx:
        hits["context"] += 1
        o = min(o, ctx - 1)  # keep the output when it fits; cut the prompt first
        p = max(1, ctx - o)
    return p, o


def _lengths(reqs: list[TraceRequest], opts: FitOptions, changes: list[str]) -> tuple[list[tuple[int, int]], set]:
    s = opts.length_scale
    if s != 1.0:
        changes.append(f"prompt and output lengths scaled x{s:g} (all {len(reqs)} requests)")
    hits, out, clipped = {"max_prompt": 0, "max_output": 0, "context": 0}, [], set()
    for i, r in enumerate(reqs):
        p, o = max(1, round(r.prompt_tokens * s)), max(1, round(r.output_tokens * s))
        cp, co = _clip(p, o, opts, hits)
        if (cp, co) != (p, o):
            clipped.add(i)
        out.append((cp, co))
    labels = {"max_prompt": f"prompts clipped to --max-prompt-tokens {opts.max_prompt_tokens}",
              "max_output": f"outputs clipped to --max-output-tokens {opts.max_output_tokens}",
              "context": f"prompt + output clipped to the model's context of {opts.context_window} tokens"}
    changes.extend(f"{labels[k]}: {n} requests" for k, n in hits.items() if n)
    return out, clipped


def fit(raw: RawTrace, opts: FitOptions = FitOptions(), source: str = "") -> Trace:
    """Select, re-time, rescale and clip a trace; every change is listed with its request count."""
    reqs, changes = list(raw.requests), []
    if opts.num_requests is not None and opts.num_requests < len(reqs):
        changes.append(f"kept the first {opts.num_requests} of {len(reqs)} requests")
        reqs = reqs[:opts.num_requests]
    times = _arrivals(raw, reqs, opts, changes)
    lengths, clipped = _lengths(reqs, opts, changes)
    # a length scale scales the hash blocks too: a shared prefix stays the same share of each prompt
    out = tuple(TraceRequest(t, p, o, r.prompt_text, r.hash_ids,
                             max(1, round(r.hash_block * opts.length_scale)) if r.hash_ids else r.hash_block)
                for t, (p, o), r in zip(times, lengths, reqs))
    return Trace(out, source, raw.format, tuple(changes), frozenset(clipped))


def load_trace(path, opts: FitOptions = FitOptions(),
               count_tokens: Optional[Callable[[str], int]] = None) -> Trace:
    """Read and fit a trace file in one call."""
    return fit(read_trace(path, count_tokens), opts, str(path))
