"""ALISE's latency model: how long a job still needs, from its (predicted) lengths.

Profiling shows both phases are linear (ALISE §3.2)::

    T_pre(s)    = s · T0            prefill of s tokens
    T_dec(s, n) = n · (α·s + β)     n decode steps at context length s

``fit`` recovers ``T0``, ``α`` and ``β`` from profiled points by ordinary least squares (numpy's).
The scheduler only ranks jobs by these estimates, so the model must be monotone and cheap, not
exact.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from typing import Iterable, Optional

from scheduling.dispatch import predicted_max_output
from scheduling.request import Request

PrefillPoint = tuple[int, float]  # (prompt tokens s, seconds)
DecodePoint = tuple[int, int, float]  # (context s, decode steps n, seconds)


@dataclass(frozen=True)
class LatencyModel:
    """Fitted coefficients. Defaults are this project's CPU measurements (DESIGN.md: a 512-token
    chunk in 0.2 s, about 41 ms per decode step at batch 1), good enough to rank jobs before a
    profile of the real instance exists."""

    t0: float = 4e-4  # seconds per prefill token
    alpha: float = 1e-5  # seconds per decode step per token of context
    beta: float = 0.04  # seconds per decode step at zero context

    def __post_init__(self):
        if min(self.t0, self.alpha, self.beta) < 0:
            raise ValueError(f"latency coefficients must be >= 0, got {self}")

    def prefill_s(self, num_tokens: int) -> float:
        """T_pre(s): seconds to prefill ``num_tokens`` tokens."""
        return num_tokens * self.t0

    def decode_s(self, context: float, num_steps: int) -> float:
        """T_dec(s, n): seconds for ``num_steps`` decode steps at context length ``context``."""
        return num_steps * (self.alpha * context + self.beta)

    def fit(self, prefill_points: Iterable[PrefillPoint] = (),
            decode_points: Iterable[DecodePoint] = ()) -> "LatencyModel":
        """A model fitted to profiled points; a phase without points keeps its coefficients."""
        model = self
        prefill_points = list(prefill_points)
        if prefill_points:
            model = replace(model, t0=_fit_through_origin(prefill_points))
        decode_points = list(decode_points)
        if decode_points:
            alpha, beta = _fit_decode(decode_points)
            model = replace(model, alpha=alpha, beta=beta)
        return model

    def estimate_remaining(self, request: Request, max_output: Optional[int] = None) -> float:
        """Seconds the request still needs if run alone: what is left of its (re)prefill plus its
        remaining decode steps.

        The output bound is ``max_output`` when the caller tracks its own (ALISE doubles a
        prediction the job outgrew), else the prediction's upper end: a bucket ``[lo, hi)``
        holds at most ``hi - 1`` tokens (``predicted_max_output``), and an upper bound is what
        keeps a long job from posing as a short one and jumping the queue on the strength of
        the bucket's optimistic end. Without a prediction ``max_tokens`` is the only bound.
        """
        bound = predicted_max_output(request) if max_output is None else max_output
        seconds, produced = 0.0, request.num_output_tokens
        if request.in_prefill:
            # the (re)prefill computes the uncomputed tokens and samples one more token
            seconds += self.prefill_s(request.num_uncomputed_tokens)
            produced += 1
        steps = max(0, bound - produced)
        # per-step cost grows with context; the mean context over the steps makes the sum exact
        mean_context = request.num_tokens + (steps - 1) / 2 if steps else 0
        return seconds + self.decode_s(mean_context, steps)


def _fit_through_origin(points: list[PrefillPoint]) -> float:
    """Least-squares slope of ``t = T0 · s`` (no intercept: zero tokens take no time)."""
    sxx = sum(s * s for s, _ in points)
    if sxx == 0:
        raise ValueError("prefill points need at least one s > 0")
    return max(0.0, sum(s * t for s, t in points) / sxx)


def _fit_decode(points: list[DecodePoint]) -> tuple[float, float]:
    """Least squares of ``t = α·(n·s) + β·n`` over the points (two features, no intercept).

    With every point at one context length α is not identifiable (the design has rank 1), and a
    negative α (noise on a flat profile) would rank long contexts as faster: both cases fall back
    to α = 0 and fit β alone.
    """
    if any(n <= 0 for _, n, _ in points):
        raise ValueError("decode points need n >= 1 steps")
    a = np.array([(n * s, n) for s, n, _ in points], dtype=float)  # [P, 2]: features of α and β
    t = np.array([t for _, _, t in points], dtype=float)
    (alpha, beta), _, rank, _ = np.linalg.lstsq(a, t, rcond=None)
    if rank == 2:
        if alpha >= 0 and beta >= 0:
            return float(alpha), float(beta)
        if beta < 0 <= alpha:  # a line through the origin fits better than any β >= 0
            return float(a[:, 0] @ t / (a[:, 0] @ a[:, 0])), 0.0
    return 0.0, max(0.0, float(a[:, 1] @ t / (a[:, 1] @ a[:, 1])))


def fit(prefill_points: Iterable[PrefillPoint], decode_points: Iterable[DecodePoint]) -> LatencyModel:
    """A latency model fitted from scratch to profiled prefill and decode points."""
    return LatencyModel().fit(prefill_points, decode_points)
