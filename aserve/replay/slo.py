"""Service-level objectives: which requests are *good*, and the goodput they make.

A request is good when it completed and meets every SLO given (``vllm bench serve --goodput``'s
rule); *attainment* is the share of a trace's requests that are good, ``request_goodput`` the good
requests per second of the run (vLLM's name), goodput per device that over the devices used.

    key        what is held to the limit (per request)
    ttft       arrival -> first token
    tpot       mean time per output token after the first (vLLM's TPOT; 0 with one token)
    token_gap  the request's own largest gap between two tokens (a stall is what a reader sees;
               a P99 over every gap of a run does not see one request's 40 s stall)
    e2el       arrival -> last token (vLLM's e2el; our JCT)
    norm       JCT per output token

Two ways to state limits, one object (``Slo``):

- absolute: ``--goodput ttft:250 tpot:100`` (vLLM's form, milliseconds) or ``--slo ttft=1,tpot=200ms``;
- a named corner (``--slo balanced``): multiples of the device's own unloaded costs, read from its
  measured or simulated profile, so one corner means the same on this CPU, a simulated V100 and a
  GPU. Per request, with ``prefill(p)`` = its prompt prefilled alone in one step and ``step(c)`` =
  a batch-1 decode step at context ``c``:

      TTFT      <= a x prefill(p) + b x step(p)
      TPOT      <= c x step(p + o)
      token gap <= d x step(p + o)

      corner       a     b     c     d     reading
      balanced     3     5     5    25     DistServe's chatbot SLOs in device units; Sarathi's relaxed TBT
      tight-ttft   1.5   2    25    25     TTFT halved, TPOT relaxed x5
      tight-tpot  15    25     2     5     TTFT relaxed x5; TPOT and the gap tight (Sarathi's strict TBT)

Where the numbers come from (docs/notes/goodput.md has the arithmetic): DistServe (OSDI'24) holds
its OPT-13B chatbot to 0.25 s TTFT and 0.1 s TPOT on A100s; by the same roofline as our V100
profile an A100-80GB decode step of OPT-13B is about 18 ms (TPOT 0.1 s = 5.4 steps) and a
200-token prompt about 51 ms (0.25 s = 3 x prefill + 5 steps): ``balanced``. Sarathi-Serve's strict TBT SLO
is 5x a decode-only iteration, its relaxed one 25x: the token gap of ``tight-tpot`` and of the
others. The tight corners halve the tight side (TTFT, or TPOT to 2 steps) and relax the other
5x, the ratio of Sarathi's strict to relaxed SLO. ``b`` is a floor for short prompts: a request
that arrives while a step runs waits for it, and a 20-token prompt's prefill is one step.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

KEYS = {"ttft": "time to first token", "tpot": "the request's mean time per output token after the first (TPOT)",
        "token_gap": "the request's own largest gap between two tokens", "e2el": "end-to-end latency (JCT)",
        "norm": "normalized latency (JCT per output token)"}
ALIASES = {"tbt": "tpot", "jct": "e2el"}  # older names of the same measures
HINTS = {"itl": "itl is every gap of a run; a request's largest gap is token_gap"}
ATTAINMENT_TARGET = 0.9  # DistServe's: goodput is the highest rate at which 90% of requests are good


@dataclass(frozen=True)
class Term:
    """One limit: ``seconds`` (absolute), or ``scale`` x the request's unloaded reference
    (prefill for TTFT, a decode step for the rest) + ``floor`` decode steps."""

    seconds: Optional[float] = None
    scale: float = 0.0
    floor: float = 0.0

    def __post_init__(self):
        values = (self.seconds,) if self.seconds is not None else (self.scale, self.floor)
        if not all(math.isfinite(v) and v >= 0 for v in values) or not any(values):
            raise ValueError(f"an SLO term needs seconds > 0, or a scale or floor > 0: {self}")

    @property
    def relative(self) -> bool:
        return self.seconds is None

    def text(self, key: str) -> str:
        if not self.relative:
            return f"{self.seconds * 1000:g} ms"
        ref = "prefill" if key == "ttft" else "step"
        parts = [f"{self.scale:g} x {ref}"] if self.scale else []
        return " + ".join(parts + ([f"{self.floor:g} x step"] if self.floor else []))


def _corner(ttft: tuple, tpot: float, gap: float) -> dict:
    return {"ttft": Term(scale=ttft[0], floor=ttft[1]), "tpot": Term(scale=tpot), "token_gap": Term(scale=gap)}


CORNERS = {
    "balanced": _corner((3.0, 5.0), 5.0, 25.0),
    "tight-ttft": _corner((1.5, 2.0), 25.0, 25.0),
    "tight-tpot": _corner((15.0, 25.0), 2.0, 5.0),
}


class UnloadedCosts:
    """A device's unloaded costs from its cost model (aserve/engine/cost_model.py): a prompt
    prefilled alone in one step, and a batch-1 decode step at a context."""

    def __init__(self, cost, device: str):
        """``cost``: a cost model, or a function returning one, called on first need (``serve``
        names its SLO at start-up without profiling a device whose settings are all given)."""
        self._cost, self.device = cost, device

    @property
    def cost(self):
        if not self.resolved:
            self._cost = self._cost()
        return self._cost

    @property
    def resolved(self) -> bool:
        """Whether the cost model is at hand (a function given for it has been called)."""
        return not callable(self._cost)

    @functools.lru_cache(maxsize=8192)
    def prefill_s(self, prompt_tokens: int) -> float:
        return self.cost.prefill_s(max(1, prompt_tokens))

    @functools.lru_cache(maxsize=8192)
    def step_s(self, context: int) -> float:
        return self.cost.decode_s(1, max(1, context))

    def alone(self, prompt_tokens: int, output_tokens: int) -> dict:
        """What a request would measure alone on the device (the best it can do)."""
        step = self.step_s(prompt_tokens + output_tokens)
        ttft = self.prefill_s(prompt_tokens)
        e2el = ttft + max(0, output_tokens - 1) * step
        return {"ttft": ttft, "tpot": step if output_tokens > 1 else 0.0,
                "token_gap": step if output_tokens > 1 else 0.0, "e2el": e2el, "norm": e2el / max(1, output_tokens)}


@dataclass(frozen=True)
class Slo:
    """A set of limits (``terms``: key -> Term), named (a corner, or ``custom``); ``costs`` are the
    device's unloaded costs, needed where a term is relative."""

    name: str
    terms: tuple  # ((key, Term), ...), in KEYS order
    costs: Optional[UnloadedCosts] = field(default=None, compare=False)

    def __post_init__(self):
        if not self.terms:
            raise ValueError("an SLO needs at least one limit")
        if self.relative and self.costs is None:
            raise ValueError(f"SLO {self.name!r} is relative to the device's unloaded costs: resolve it with them")

    @property
    def relative(self) -> bool:
        return any(t.relative for _, t in self.terms)

    def limits(self, prompt_tokens: int, output_tokens: int) -> dict[str, float]:
        """Seconds per key for a request of these lengths."""
        out = {}
        for key, t in self.terms:
            if not t.relative:
                out[key] = t.seconds
                continue
            step = self.costs.step_s(prompt_tokens if key == "ttft" else prompt_tokens + output_tokens)
            ref = self.costs.prefill_s(prompt_tokens) if key == "ttft" else step
            out[key] = t.scale * ref + t.floor * step
        return out

    def step_limit_s(self, context: int, keys: Sequence[str] = ("tpot", "token_gap")) -> Optional[float]:
        """The longest step a request decoding at ``context`` may see in every one of its steps and
        still keep each limit of ``keys`` present (a token gap is one step; TPOT is their mean, so
        a step within it keeps it whatever the mix): the smallest of those limits, in seconds.
        None when the SLO has none of ``keys``. What a token budget is sized for (Sarathi-Serve's
        rule, with the SLO in force: ``aserve/commands/common.py``, ``--tbt-slo``)."""
        limits = []
        for key, t in self.terms:
            if key not in keys:
                continue
            limits.append(t.seconds if not t.relative else (t.scale + t.floor) * self.costs.step_s(context))
        return min(limits) if limits else None

    def describe(self, requests: Sequence) -> str:
        """One line: each limit's rule and what it works out to over these requests (lengths)."""
        parts = []
        for key, t in self.terms:
            values = self.values(requests, key)
            if not t.relative or not values:
                parts.append(f"{key} <= {t.text(key)}")
                continue
            lo, mid, hi = values["min"], values["p50"], values["max"]
            spread = f"{mid:.3g} s" if math.isclose(lo, hi, rel_tol=0.05) else f"{mid:.3g} s (median; {lo:.3g}-{hi:.3g})"
            parts.append(f"{key} <= {t.text(key)} = {spread}")
        where = f" on {self.costs.device}" if self.relative else ""
        return f"SLO {self.name}{where}: " + "; ".join(parts)

    def values(self, requests: Sequence, key: str) -> Optional[dict]:
        """min / p50 / max of ``key``'s limit over ``requests`` (anything with prompt and output tokens)."""
        limits = [self.limits(*_lengths(r))[key] for r in requests]
        if not limits:
            return None
        return {"min": float(min(limits)), "p50": float(np.median(limits)), "max": float(max(limits))}

    def to_json(self, requests: Sequence) -> dict:
        out = {"name": self.name, "rule": "a request is good if it completed and meets every limit",
               "terms": {k: ({"seconds": t.seconds} if not t.relative else {"scale": t.scale, "floor_steps": t.floor})
                         for k, t in self.terms},
               "seconds": {k: self.values(requests, k) for k, _ in self.terms},
               "meaning": {k: KEYS[k] for k, _ in self.terms}}
        if self.relative:
            lengths = [_lengths(r) for r in requests] or [(1, 1)]
            p = int(np.median([a for a, _ in lengths]))
            c = int(np.median([a + b for a, b in lengths]))
            out["device"] = self.costs.device
            out["unloaded"] = {"median_prompt_tokens": p, "prefill_s_at_median_prompt": self.costs.prefill_s(p),
                               "median_context": c, "decode_step_s_at_median_context": self.costs.step_s(c)}
        return out

    def meetable_share(self, requests: Sequence) -> float:
        """The share of ``requests`` that could meet every limit alone on the device (1.0 without costs)."""
        if self.costs is None or not requests:
            return 1.0
        ok = 0
        for r in requests:
            p, o = _lengths(r)
            alone, limits = self.costs.alone(p, o), self.limits(p, o)
            ok += all(alone[k] <= v for k, v in limits.items())
        return ok / len(requests)


def _lengths(r) -> tuple[int, int]:
    """(prompt tokens, output tokens) of a TraceRequest or a RequestRecord."""
    return r.prompt_tokens, getattr(r, "target_output_tokens", None) or r.output_tokens


# ---- parsing --------------------------------------------------------------------------------------
def _key(name: str, flag: str, form: str) -> str:
    key = ALIASES.get(name, name)
    if key not in KEYS:
        hint = f" ({HINTS[name]})" if name in HINTS else ""
        raise ValueError(f"bad {flag} key {name!r}{hint}: use {form} with KEY one of {', '.join(KEYS)}")
    return key


def _positive(value: float, what: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be > 0 (no request meets a limit of {value:g}), got {value:g}")
    return value


def parse_slo_text(text: str) -> tuple[str, dict]:
    """``--slo``: a corner name, ``ttft=1,tpot=200ms`` (seconds, or ms with a suffix), or
    ``ttft:250,tpot:100`` (vLLM's form, milliseconds)."""
    text = text.strip()
    if text in CORNERS:
        return text, dict(CORNERS[text])
    if ":" in text and "=" not in text:
        return "custom", parse_goodput([text])
    if "=" not in text:
        raise ValueError(f"unknown SLO corner {text!r}: use one of {', '.join(CORNERS)}, or limits like "
                         "ttft=1,tpot=200ms")
    terms = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep:
            raise ValueError(f"bad --slo item {part.strip()!r}: use KEY=SECONDS (or a corner: {', '.join(CORNERS)})")
        key = _key(name.strip(), "--slo", "KEY=SECONDS")
        try:
            seconds = float(value[:-2]) / 1000 if value.endswith("ms") else float(value.rstrip("s"))
        except ValueError:
            raise ValueError(f"bad --slo value {value!r} for {key}: seconds, e.g. 0.2 or 200ms") from None
        terms[key] = Term(seconds=_positive(seconds, f"--slo {key}"))
    return "custom", terms


def parse_goodput(items: Iterable[str]) -> dict:
    """``--goodput ttft:250 tpot:100``: vLLM's form, KEY:MILLISECONDS (items may also be joined
    by commas)."""
    terms = {}
    for item in (x for raw in items for x in raw.replace(",", " ").split()):
        name, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"bad --goodput item {item!r}: use KEY:MILLISECONDS, e.g. --goodput ttft:250 tpot:100 "
                             f"(KEY one of {', '.join(KEYS)})")
        key = _key(name, "--goodput", "KEY:MILLISECONDS")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput value {value!r} for {key}: milliseconds, e.g. {key}:250") from None
        terms[key] = Term(seconds=_positive(ms, f"--goodput {key}") / 1000)
    return terms


def build_slo(slo_text: Optional[str], goodput: Optional[Sequence[str]], costs_for=None) -> Optional[Slo]:
    """``--slo`` and ``--goodput`` as one ``Slo`` (``--goodput`` adds to or replaces a corner's
    limits); ``costs_for()`` gives the device's ``UnloadedCosts``, called only if a term is relative.
    None when neither flag is given."""
    if not slo_text and not goodput:
        return None
    name, terms = parse_slo_text(slo_text) if slo_text else ("custom", {})
    extra = parse_goodput(goodput or ())
    if extra and slo_text in CORNERS:
        name = f"{name} + " + " ".join(f"{k}:{t.seconds * 1000:g}" for k, t in extra.items())
    terms.update(extra)
    ordered = tuple((k, terms[k]) for k in KEYS if k in terms)
    relative = any(t.relative for _, t in ordered)
    return Slo(name, ordered, costs_for() if relative and costs_for else None)


# ---- judging requests -----------------------------------------------------------------------------
def request_values(r) -> dict:
    """The SLO measures of one completed ``RequestRecord``."""
    t = r.token_times
    gaps = [b - a for a, b in zip(t, t[1:])]
    e2el = r.finish_s - r.arrival_s
    return {"ttft": r.first_token_s - r.arrival_s,
            "tpot": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0,
            "token_gap": max(gaps, default=0.0), "e2el": e2el, "norm": e2el / max(1, r.output_tokens)}


def misses(r, slo: Slo) -> tuple[str, ...]:
    """The keys ``r`` misses (``("failed",)`` for a request that did not complete); () = good."""
    if r.status != "completed" or r.first_token_s is None:
        return ("failed",)
    values, limits = request_values(r), slo.limits(*_lengths(r))
    return tuple(k for k, limit in limits.items() if values[k] > limit)


def attainment(records: Sequence, slo: Slo) -> dict:
    """``{"good", "num_requests", "slo_attainment", "misses": {key: requests missing it}}``."""
    counts = {k: 0 for k, _ in slo.terms}
    good = 0
    for r in records:
        missed = misses(r, slo)
        good += not missed
        for k in missed:
            counts[k] = counts.get(k, 0) + 1
    n = len(records)
    return {"good": good, "num_requests": n, "slo_attainment": good / n if n else None, "misses": counts}
