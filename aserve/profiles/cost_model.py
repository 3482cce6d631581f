"""A device's step time as a function of the step's rows: the model the schedulers' settings are
derived from, and the one a simulated device runs on.

    t(step) = linear(T) - logits_row · (T - sampled)
              + attn_prefill · Σ_chunks n·(start + (n + 1) / 2) + attn_decode · Σ_decodes ctx
                │                          └ query-key pairs of each prompt chunk
                └ T = rows computed (padding included), interpolated over measured T:
                  weight reads, the products, norms and the per-step overhead

``linear`` is timed on decode rows, each of which produces logits; ``logits_row`` is what a row
that produces none (a prompt row before its chunk's last, padding) takes back: the LM head and
what else a decode row pays alone (its attention call, its sampler), a quarter of a small model's
per-row work, fitted on prompt chunks with the pairs' price (``fit_prefill``; 0 in a profile that
never measured it: ``aserve profile device --from-steps`` fits it on steps timed inside replays,
aserve/profiles/calibrate.py).

``linear`` is a table (a batch-1 step is bound by reading the weights, a 2,048-row one by the
products: no straight line fits both); the two attention terms are per pair and per token of
context read. ``contention`` is how much slower a step runs while another instance on the same
memory bus is busy (this machine's two cores share one): ``t · (1 + contention)``.

``speed_trace`` (empty unless asked for) is how fast the machine ran minute by minute in one
logged replay, as ((seconds after the start, factor), ...): a simulated device multiplies a step
that starts in a window by its factor (aserve/devices/sim_device.py), so a validation can replay a
shared VM's drift instead of one number for the whole run (``aserve profile device --speed-window``).
The settings derived below never read it.

Measured by ``aserve profile device`` (aserve/profiles/device_profile.py) on the real engine, or
written by hand from published hardware figures (a simulated V100), as JSON.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence


@dataclass(frozen=True)
class CostModel:
    tokens: tuple[int, ...]  # the T grid, ascending
    linear_s: tuple[float, ...]  # seconds of a step of T rows with (almost) no context
    attn_prefill_s: float  # seconds per query-key pair of a prompt chunk
    attn_decode_s: float  # seconds per token of context a decode row reads
    contention: float = 0.0  # fraction slower while another instance on the bus is busy
    meta: dict = field(default_factory=dict)  # what was measured: model, device, dtype, threads, machine, date
    logits_row_s: float = 0.0  # seconds of one row's logits, part of linear(T); rows that sample none save it
    speed_trace: tuple[tuple[float, float], ...] = ()  # (window start s, factor), ascending; () = one speed

    def __post_init__(self):
        if len(self.tokens) != len(self.linear_s) or not self.tokens:
            raise ValueError("a cost model needs one linear time per grid point, and at least one point")
        if list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1:
            raise ValueError(f"the T grid must be ascending and >= 1, got {self.tokens}")
        if min(self.linear_s) < 0 or self.attn_prefill_s < 0 or self.attn_decode_s < 0 or self.contention < 0 \
                or self.logits_row_s < 0:
            raise ValueError("step costs must be >= 0")
        starts = [t for t, _ in self.speed_trace]
        if starts != sorted(set(starts)) or any(not f > 0 for _, f in self.speed_trace):
            raise ValueError(f"a speed trace needs ascending window starts and factors > 0, got {self.speed_trace}")
        object.__setattr__(self, "_linear_memo", {})  # linear(T) by T: a simulated device asks it every step

    def speed_at(self, seconds: float) -> float:
        """The speed trace's factor ``seconds`` after the start: its last window starting at or
        before then (1.0 before the first window, or with no trace)."""
        i = bisect.bisect_right(self.speed_trace, seconds, key=lambda window: window[0])  # no list a step
        return self.speed_trace[i - 1][1] if i else 1.0

    # ---- the pieces -------------------------------------------------------------------------------
    def linear(self, num_rows: int) -> float:
        """Piecewise-linear over the grid; below it, the first point; above it, the last two
        points' slope (products grow linearly once the weights are no longer the bound)."""
        t = self._linear_memo.get(num_rows)
        if t is None:
            t = self._linear_memo[num_rows] = max(0.0, sum(w * self.linear_s[i]
                                                           for i, w in linear_weights(self.tokens, num_rows)))
        return t

    @staticmethod
    def prefill_pairs(num_tokens: int, start: int) -> float:
        """Query-key pairs of a chunk of ``num_tokens`` after ``start`` cached tokens (causal)."""
        return num_tokens * (start + (num_tokens + 1) / 2)

    def step_s(self, chunks: Iterable[tuple[int, int]] = (), decode_contexts: Iterable[int] = (),
               num_pad_tokens: int = 0, busy_neighbours: int = 0, num_sampled: Optional[int] = None) -> float:
        """One step: prompt ``chunks`` as (tokens, start), decode rows by context, padding rows;
        ``num_sampled`` rows produce logits (None: every decode row and no chunk's)."""
        chunks, contexts = list(chunks), list(decode_contexts)
        rows = sum(n for n, _ in chunks) + len(contexts) + num_pad_tokens
        sampled = len(contexts) if num_sampled is None else num_sampled
        return self._priced(rows, sampled, sum(self.prefill_pairs(n, s) for n, s in chunks), sum(contexts),
                            busy_neighbours)

    def _priced(self, rows: int, sampled: int, pairs: float, context: int, busy_neighbours: int) -> float:
        """A step's seconds from its sums: rows through the linear layers (of which ``sampled``
        produce logits), prompt query-key ``pairs``, decode ``context`` tokens read."""
        t = (self.linear(rows) - self.logits_row_s * max(0, rows - sampled)
             + self.attn_prefill_s * pairs + self.attn_decode_s * context)
        return max(0.0, t) * (1.0 + self.contention * min(1, busy_neighbours))

    def plan_s(self, plan, busy_neighbours: int = 0) -> float:
        """A ``StepPlan``'s time: ``step_s`` of its shape (``plan_shape``), taken in one pass over
        its rows (a simulated device asks it every step); the same sums in the same order, so the
        same number to the last digit."""
        rows, num_sampled, pairs, context = plan.num_pad_tokens, 0, [], 0
        for s in plan.seqs:
            n = len(s.token_ids)
            if n > 1:  # a prompt chunk (or a recompute)
                rows += n
                pairs.append(self.prefill_pairs(n, s.start_pos))
            elif n == 1:  # a decode row
                rows += 1
                context += s.start_pos + 1
            if s.sampling is not None:
                num_sampled += 1
        return self._priced(rows, num_sampled, sum(pairs), context, busy_neighbours)

    def room_step_s(self, prompt_rows: int, prompt_start: int, decode_rows: int, decode_context: int) -> float:
        """A step of one prompt chunk (``prompt_rows`` after ``prompt_start`` cached tokens) and
        ``decode_rows`` decodes reading ``decode_context`` tokens between them: ``step_s`` from the
        sums alone, as a step room sizes a step (scheduling/coupled.py ``StepRoom``)."""
        pairs = self.prefill_pairs(prompt_rows, prompt_start) if prompt_rows > 0 else 0.0
        return self._priced(prompt_rows + decode_rows, decode_rows + (prompt_rows > 0), pairs, decode_context, 0)

    def prefill_s(self, num_tokens: int, start: int = 0) -> float:
        return self.step_s([(num_tokens, start)])

    def decode_s(self, batch: int, context: int) -> float:
        return self.step_s(decode_contexts=[context] * batch)

    def hybrid_s(self, budget: int, decode_batch: int, context: int) -> float:
        """A Sarathi iteration: ``decode_batch`` decodes at ``context`` plus a chunk of the rest of
        ``budget`` continuing a prompt whose first ``context`` tokens are cached."""
        chunk = max(0, budget - decode_batch)
        return self.step_s([(chunk, context)] if chunk else [], [context] * decode_batch)

    # ---- settings derived from it -------------------------------------------------------------------
    def saturate_chunk(self, tile: int = 16, within: float = 0.10, max_chunk: Optional[int] = None) -> int:
        """TetriInfer's ChunkSize (its Figure 2): the smallest chunk, a multiple of ``tile``, whose
        prefill tokens/s is within ``within`` of the best chunk's up to ``max_chunk``."""
        top = max_chunk or self.tokens[-1]
        sizes = list(range(tile, top + 1, tile))
        rate = {n: n / self.prefill_s(n) for n in sizes}
        best = max(rate.values())
        return min(n for n in sizes if rate[n] >= (1 - within) * best)

    def decode_slo_s(self, decode_batch: int, context: int, factor: float = 5.0) -> float:
        """Sarathi-Serve's strict TBT SLO: ``factor`` times a decode-only iteration's time."""
        return factor * self.decode_s(decode_batch, context)

    def token_budget(self, slo_s: float, decode_batch: int, context: int, tile: int = 16) -> int:
        """The largest budget, a multiple of ``tile`` and at least the decode batch, whose hybrid
        iteration at ``context`` meets ``slo_s`` (the decode batch alone when none does: Sarathi
        never stalls a decode for a chunk)."""
        lo = max(tile, math.ceil(decode_batch / tile) * tile)
        if self.hybrid_s(lo, decode_batch, context) > slo_s:
            return lo
        hi = lo
        while self.hybrid_s(hi * 2, decode_batch, context) <= slo_s and hi < 1 << 20:
            hi *= 2
        top = hi * 2  # over the SLO (or absurdly large)
        while top - hi > tile:  # hybrid time grows with the budget: bisect over multiples of tile
            mid = (hi + top) // 2 // tile * tile
            if self.hybrid_s(mid, decode_batch, context) <= slo_s:
                hi = mid
            else:
                top = mid
        return hi

    # ---- files --------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = asdict(self)
        if not self.speed_trace:
            del data["speed_trace"]  # one speed: the file as before traces existed
        return data

    @staticmethod
    def from_json(data: dict) -> "CostModel":
        known = {"tokens", "linear_s", "attn_prefill_s", "attn_decode_s", "contention", "logits_row_s", "meta",
                 "speed_trace"}
        missing = {"tokens", "linear_s", "attn_prefill_s", "attn_decode_s"} - set(data)
        if missing:
            raise ValueError(f"a cost model needs {', '.join(sorted(missing))}")
        args = {k: v for k, v in data.items() if k in known}
        if "speed_trace" in args:
            args["speed_trace"] = tuple((float(t), float(f)) for t, f in args["speed_trace"])
        return CostModel(tokens=tuple(int(t) for t in args.pop("tokens")),
                         linear_s=tuple(float(x) for x in args.pop("linear_s")), **args)

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2))
        return path

    @staticmethod
    def load(path) -> "CostModel":
        try:
            return CostModel.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"bad cost model file {str(path)!r}: {e}") from None


def linear_weights(tokens: Sequence[int], num_rows: int) -> list[tuple[int, float]]:
    """``linear(num_rows)`` as (grid index, weight) pairs over an ascending grid: the first point
    below it, the last segment's line above it (its weight on the lower point goes negative),
    else the two points around it. The table is linear in its values: a fit solves for them."""
    if num_rows <= 0:
        return []
    if num_rows <= tokens[0] or len(tokens) == 1:
        return [(0, 1.0)]
    i = bisect.bisect_left(tokens, num_rows)
    if i == len(tokens):
        i -= 1  # extrapolate with the last segment
    f = (num_rows - tokens[i - 1]) / (tokens[i] - tokens[i - 1])
    return [(i - 1, 1.0 - f), (i, f)]


def plan_shape(plan) -> tuple[list[tuple[int, int]], list[int], int, int]:
    """What a ``StepPlan`` costs by: prompt chunks as (tokens, start) (rows of more than one token:
    chunks or recomputes), decode rows' contexts, padding rows, and the rows that sample a token."""
    chunks = [(s.num_tokens, s.start_pos) for s in plan.seqs if s.num_tokens > 1]
    contexts = [s.start_pos + 1 for s in plan.seqs if s.num_tokens == 1]
    return chunks, contexts, plan.num_pad_tokens, sum(s.sampling is not None for s in plan.seqs)


def fit_prefill(points: Sequence[tuple[float, float, float]], floor: float = 0.0) -> tuple[float, float]:
    """(row saving, per pair) from prompt chunks timed as (rows that sample nothing, query-key
    pairs, seconds beyond ``linear`` of the chunk's rows): the least-squares fit of
    ``extra = -saving * rows + per_pair * pairs``, neither negative and the saving at least ``floor``
    (the LM head timed alone). A decode row, which ``linear`` is timed on, pays more than the LM
    head a prompt row skips (its own attention call and sampler): fitted apart from the pairs,
    that difference no longer leaks into the pair's price (one slope over both read 743 against
    ~1,000 ns a pair here and priced chunks from position 0 9-13% long)."""
    import numpy as np

    a = np.array([[-u, p] for u, p, _ in points], dtype=float)
    y = np.array([e for _, _, e in points], dtype=float)
    if len(points) >= 2 and np.linalg.matrix_rank(a) == 2:
        (saving, per_pair), *_ = np.linalg.lstsq(a, y, rcond=None)
        if saving >= floor and per_pair >= 0:
            return float(saving), float(per_pair)
    # the saving at its floor, the pairs' slope alone over what is left
    return floor, fit_attention([(p, e + floor * u) for u, p, e in points])


def fit_attention(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope through the origin of (x, extra seconds) points, never negative."""
    sxx = sum(x * x for x, _ in points)
    if sxx <= 0:
        return 0.0
    return max(0.0, sum(x * y for x, y in points) / sxx)
