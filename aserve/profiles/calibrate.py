"""A cost model refitted on steps timed inside real replays (``aserve profile device --from-steps``).

``aserve profile device`` times steps one at a time on a quiet machine; in a replay steps follow
each other on warm caches, prompt chunks compute logits for one row where the profile's decode
rows each computed theirs, and a neighbour instance shares the memory bus. The step log
(aserve/engine/step_log.py) records what a replay really ran; this refits the same model on it.

The model (aserve/profiles/cost_model.py) is linear in its unknowns for a given contention:

    t_k / (1 + c · b_k) = Σ_i w_i(T_k) · y_i + attn_prefill · P_k + attn_decode · D_k - logits_row · U_k

with ``w_i`` the table's interpolation weights at the step's rows ``T_k``, ``P_k`` its prompt
query-key pairs, ``D_k`` its decode contexts, ``U_k`` its rows that sample no token, ``b_k`` 1 if a
neighbour was stepping when it started. So: non-negative least squares on the relative error
of every step (a 20 ms decode step counts as much as a 2 s prompt), plus a ridge row per unknown
pulling it toward the base profile's value in relative terms (``ridge`` = as strong as that many
steps off by 100%): a grid point no step touches keeps its measured value exactly, one few steps
touch moves only as far as they insist. Contention, for given others, is a one-unknown least
squares; the two alternate until contention settles. The grid gains doublings of its last point
up to the longest step logged (their prior: the base's own extrapolation), so long prompts are
fitted, not extrapolated.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
from scipy.optimize import nnls

from aserve.profiles.cost_model import CostModel, linear_weights
from aserve.engine.step_log import LoggedStep

KINDS = ("prefill", "decode", "mixed", "all")


def predict(model: CostModel, step: LoggedStep) -> float:
    return model.step_s(step.chunks, step.decodes, step.pad, step.neighbours, step.sampled)


@dataclass(frozen=True)
class StepErrors:
    """How far a model is from logged steps, by kind: |pred - real| / real's median and P90, and
    the summed time's error (what a replay's busy time would be off by)."""

    num_steps: int
    median: float
    p90: float
    total: float  # Σ pred / Σ real - 1

    def as_dict(self) -> dict:
        return {"steps": self.num_steps, "median": self.median, "p90": self.p90, "total": self.total}


def errors(model: CostModel, steps: Sequence[LoggedStep]) -> dict[str, StepErrors]:
    """``StepErrors`` of ``model`` on ``steps`` per kind (prefill-only, decode-only, mixed) and all."""
    out = {}
    for kind in KINDS:
        mine = [s for s in steps if kind == "all" or s.kind == kind]
        if not mine:
            continue
        pred = [predict(model, s) for s in mine]
        rel = sorted(abs(p / s.seconds - 1.0) for p, s in zip(pred, mine))
        p90 = rel[min(len(rel) - 1, int(0.9 * len(rel)))]
        out[kind] = StepErrors(len(mine), statistics.median(rel), p90,
                               sum(pred) / sum(s.seconds for s in mine) - 1.0)
    return out


def usable(steps: Sequence[LoggedStep]) -> list[LoggedStep]:
    """Steps the model can describe: some rows computed, a positive time, no KV swapped (the
    model has no term for swaps)."""
    return [s for s in steps if s.rows > 0 and s.seconds > 0 and not s.swapped]


SPEED_ON = ("all", "decode", "prompt")


def speed(base: CostModel, steps: Sequence[LoggedStep], on: str = "all") -> float:
    """How fast the machine ran in the logged minutes against ``base``. ``on="all"``: summed
    measured over summed predicted time of every usable step, so the scaled profile's busy time is
    the run's (where the base's shape is off for some kind of step, that kind's share of the run
    moves the number). ``on="decode"``: the median of measured / predicted over the usable
    decode-only steps (every policy runs them, so the policy's mix of prompt work does not weigh
    in; it validated worse: 18 of 78 cells over against 6, docs/notes/simulator.md). A shared VM
    drifts by tens of percent over hours, so a profile measured at one time describes another run
    only at that run's speed. ``on="prompt"``: the same median over the steps with a prompt chunk
    (bound by the cores' arithmetic where decode steps are bound by memory: a VM's compute can
    slow while its memory reads do not, so a validation reads the two apart)."""
    if on not in SPEED_ON:
        raise ValueError(f"bad speed statistic {on!r}: choose one of {', '.join(SPEED_ON)}")
    if on == "all":
        mine = usable(steps)
        if not mine:
            raise ValueError("no usable step in the logs to read the speed off")
        return sum(s.seconds for s in mine) / sum(predict(base, s) for s in mine)
    mine = [s for s in usable(steps) if (s.kind == "decode") == (on == "decode")]
    if not mine:
        raise ValueError(f"no usable {'decode-only' if on == 'decode' else 'prompt'} step in the logs: the speed "
                         f"is read off those steps (--speed-on all reads it off every step)")
    return statistics.median(s.seconds / predict(base, s) for s in mine)


def speed_trace(model: CostModel, steps: Sequence[LoggedStep], window_s: float,
                min_steps: int = 10) -> tuple[tuple[float, float], ...]:
    """How fast the machine ran in each ``window_s`` of one logged replay against ``model``:
    per window (by when its steps started), summed measured over summed predicted time of its
    usable steps; a window with fewer than ``min_steps`` of them (or none) keeps 1.0. Against a model
    already at the run's speed (``scaled`` by ``speed``), the factors average 1 weighted by
    predicted time: they move the run's time between its minutes, not its total."""
    if not window_s > 0:
        raise ValueError(f"a speed window must be > 0 seconds, got {window_s}")
    sums: dict[int, list] = {}
    for s in usable(steps):
        acc = sums.setdefault(int(s.t // window_s), [0.0, 0.0, 0])
        acc[0] += s.seconds
        acc[1] += predict(model, s)
        acc[2] += 1
    if not sums:
        raise ValueError("no usable step in the logs to read a speed trace off")
    trace = []
    for k in range(min(sums), max(sums) + 1):  # a window without steps keeps 1.0 too
        m, p, n = sums.get(k, (0.0, 0.0, 0))
        trace.append((k * window_s, m / p if n >= min_steps and p > 0 else 1.0))
    return tuple(trace)


def scaled(base: CostModel, factor: float) -> CostModel:
    """``base`` with every cost times ``factor`` (contention, a ratio, unchanged)."""
    return replace(base, linear_s=tuple(y * factor for y in base.linear_s), attn_prefill_s=base.attn_prefill_s * factor,
                   attn_decode_s=base.attn_decode_s * factor, logits_row_s=base.logits_row_s * factor)


def extended_grid(base: CostModel, steps: Sequence[LoggedStep]) -> CostModel:
    """``base`` with its grid doubled past its last point up to the longest step logged, the new
    points at the base's own extrapolation (the prior the fit pulls them toward)."""
    tokens = list(base.tokens)
    longest = max((s.rows for s in steps), default=0)
    while tokens[-1] < longest:
        tokens.append(tokens[-1] * 2)
    if len(tokens) == len(base.tokens):
        return base
    return replace(base, tokens=tuple(tokens), linear_s=tuple(base.linear(t) for t in tokens))


class _Design:
    """The steps as a linear system over [y_0 .. y_G-1, attn_prefill, attn_decode, logits_row]."""

    def __init__(self, grid: Sequence[int], steps: Sequence[LoggedStep]):
        g = len(grid)
        self.x = np.zeros((len(steps), g + 3))
        for k, s in enumerate(steps):
            for i, w in linear_weights(grid, s.rows):
                self.x[k, i] += w
            self.x[k, g] = sum(CostModel.prefill_pairs(n, st) for n, st in s.chunks)
            self.x[k, g + 1] = sum(s.decodes)
            self.x[k, g + 2] = -max(0, s.rows - s.sampled)
        self.real = np.array([s.seconds for s in steps])
        self.busy = np.array([min(1, s.neighbours) for s in steps], dtype=float)


def _unknowns(m: CostModel) -> np.ndarray:
    return np.array([*m.linear_s, m.attn_prefill_s, m.attn_decode_s, m.logits_row_s])


def _scales(base: np.ndarray, d: _Design) -> np.ndarray:
    """Each unknown's unit: its base value, or where that is 0 the value that alone would
    explain the mean step (keeps the solver's columns of one size)."""
    mean = float(d.real.mean())
    col = np.abs(d.x).mean(axis=0)
    fallback = np.where(col > 0, mean / np.maximum(col, 1e-300), 1.0)
    return np.where(base > 0, base, fallback)


def _solve(d: _Design, base: np.ndarray, contention: float, ridge: float) -> np.ndarray:
    """Non-negative least squares of the relative errors for a given contention, with the ridge."""
    scale = _scales(base, d)
    a = d.x * scale * ((1.0 + contention * d.busy) / d.real)[:, None]
    b = np.ones(len(d.real))
    pulled = np.flatnonzero(base > 0)
    if ridge > 0 and len(pulled):
        rows = np.zeros((len(pulled), len(base)))
        rows[np.arange(len(pulled)), pulled] = np.sqrt(ridge)  # (u_j - 1) in units of the base value
        a, b = np.vstack([a, rows]), np.concatenate([b, np.full(len(pulled), np.sqrt(ridge))])
    u, _ = nnls(a, b, maxiter=50 * a.shape[1])
    return u * scale


def _contention(d: _Design, theta: np.ndarray, prior: float, ridge: float) -> float:
    """The contention that best explains the steps beside a busy neighbour, the rest given."""
    alone = d.x @ theta
    p = alone * d.busy / d.real
    e = (d.real - alone) / d.real
    den = float(p @ p) + ridge
    return max(0.0, (float(p @ e) + ridge * prior) / den) if den > 0 else prior


def fit(base: CostModel, steps: Sequence[LoggedStep], ridge: float = 1.0, rounds: int = 20,
        fit_contention: bool = True) -> CostModel:
    """``base`` refitted on ``steps`` (module doc); its ``meta`` kept, the fit's added by the caller."""
    if ridge < 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")
    steps = usable(steps)
    if not steps:
        raise ValueError("no usable steps to fit on (every step empty, untimed or swapping)")
    prior = extended_grid(base, steps)
    d = _Design(prior.tokens, steps)
    theta0 = _unknowns(prior)
    contention, theta = prior.contention, theta0
    for _ in range(rounds if fit_contention else 1):
        theta = _solve(d, theta0, contention, ridge)
        if not fit_contention or not d.busy.any():
            break
        nxt = _contention(d, theta, prior.contention, ridge)
        if abs(nxt - contention) < 1e-5:
            contention = nxt
            break
        contention = nxt
    g = len(prior.tokens)
    return replace(prior, linear_s=tuple(float(v) for v in theta[:g]), attn_prefill_s=float(theta[g]),
                   attn_decode_s=float(theta[g + 1]), logits_row_s=float(theta[g + 2]), contention=float(contention))


def describe(fitted: CostModel, base: CostModel, steps: Sequence[LoggedStep],
             checks: Optional[Sequence[LoggedStep]] = None) -> dict:
    """The fit's record for the profile's ``meta``: errors before (the base) and after, on the
    steps fitted and on held-out ``checks``."""
    steps = usable(steps)
    out = {"fitted": {"before": _as_dicts(errors(base, steps)), "after": _as_dicts(errors(fitted, steps))}}
    if checks:
        checks = usable(checks)
        out["check"] = {"before": _as_dicts(errors(base, checks)), "after": _as_dicts(errors(fitted, checks))}
    return out


def _as_dicts(errs: dict[str, StepErrors]) -> dict:
    return {k: v.as_dict() for k, v in errs.items()}
