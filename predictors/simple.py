"""The two reference predictors: ``none`` (knows nothing) and ``oracle`` (knows the answer).

They bound what a scheduler can gain from prediction: ``none`` is what a length-blind system
does, ``oracle`` is a perfect predictor. Neither needs training.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional, Sequence

from predictors.base import Item, LengthPredictor, max_tokens_of, prompt_of
from predictors.dataset import Example
from scheduling.request import LengthRange, Request

ORACLE_ATTR = "oracle_length"


class UnknownLength(ValueError):
    """The oracle has no true length for this request (no replay length, no label, no ignore_eos)."""


class NonePredictor(LengthPredictor):
    """Always the full range ``[0, max_tokens]`` with probability 1: no information.

    Its ``bucket`` is the last one: a scheduler that reads only the bucket then treats every
    request as possibly long, which is the safe reading of "unknown".
    """

    name = "none"
    needs_fit = False
    inline = True

    def predict(self, requests: Sequence[Item]) -> list[LengthRange]:
        out = []
        for r in requests:
            cap = max_tokens_of(r) or self.buckets.max_length
            out.append(LengthRange(0, cap + 1, self.buckets.num_buckets - 1, 1.0))
        return out


class OraclePredictor(LengthPredictor):
    """The true length's bucket, with probability 1.

    Where the truth comes from, first found wins:
      1. the attribute ``oracle_length`` set on the request (replay and evaluation set it:
         ``Request`` is a plain dataclass, so ``setattr(req, "oracle_length", n)`` works);
      2. the length of a training example (an ``Example`` carries it);
      3. a table filled by ``fit`` (prompt text -> length) or ``observe``;
      4. ``sampling.max_tokens`` when the request ignores EOS (then it always runs to the cap).
    Anything else is an error: an oracle that guesses is no oracle.
    """

    name = "oracle"
    needs_fit = False
    inline = True

    def __init__(self, granularity: int = 200, max_length: int = 1024):
        super().__init__(granularity, max_length)
        self._by_text: dict[str, int] = {}

    def fit(self, examples: Sequence[Example]) -> "OraclePredictor":
        self._by_text.update((e.prompt, e.length) for e in examples)
        return self

    def observe(self, request: Item, actual_length: int) -> None:
        self._by_text[prompt_of(request)[0]] = actual_length

    def true_length(self, r: Item) -> int:
        if getattr(r, ORACLE_ATTR, None) is not None:
            return int(getattr(r, ORACLE_ATTR))
        if isinstance(r, Example):
            return r.length
        text = r.prompt_text
        if text in self._by_text:
            return self._by_text[text]
        if isinstance(r, Request) and r.sampling.ignore_eos:
            return r.sampling.max_tokens
        raise UnknownLength(f"oracle: request {r.request_id!r} has no true length: set its attribute "
                         f"{ORACLE_ATTR!r}, fit the oracle on labelled examples, or use ignore_eos")

    def predict(self, requests: Sequence[Item]) -> list[LengthRange]:
        return [self.answer(r) for r in requests]

    def answer(self, r: Item) -> LengthRange:
        """The bucket of ``r``'s true length (within its ``max_tokens``), with probability 1."""
        bucket, cap = self.true_bucket(r)
        return self.buckets.to_range(bucket, 1.0, cap)

    def true_bucket(self, r: Item) -> tuple[int, Optional[int]]:
        n, cap = self.true_length(r), max_tokens_of(r)
        return self.buckets.bucket_of(n if cap is None else min(n, cap)), cap


class SetAccuracyPredictor(OraclePredictor):
    """The true bucket with probability ``accuracy``, else a wrong one drawn as a real predictor
    errs: by its distance from the true bucket, with the frequencies of ``confusion`` (a
    [true][predicted] count matrix from ``aserve predictor eval``; default: the shipped one of the
    ``sklearn`` backend at granularity 200 on the held-out prompts, data/confusion_sklearn_g200.json).
    A simulation's predictor: it knows the true length as the oracle does (replays set it) and
    blurs it to a stated accuracy, so the schedulers can be measured at the paper's 74.9% and at
    100% (TetriInfer Fig. 18).

    Deterministic: each request's draw depends on ``seed`` and its id only.
    """

    name = "accuracy"

    def __init__(self, granularity: int = 200, max_length: int = 2048, accuracy: float = 0.749,
                 confusion: Optional[str] = None, seed: int = 0):
        super().__init__(granularity, max_length)
        if not 0 <= accuracy <= 1:
            raise ValueError(f"accuracy must be in [0, 1], got {accuracy!r}")
        self.accuracy, self.seed = float(accuracy), int(seed)
        self.offsets = error_offsets(_read_confusion(confusion or DEFAULT_CONFUSION))

    def answer(self, r: Item) -> LengthRange:
        bucket, cap = self.true_bucket(r)
        return self.buckets.to_range(self.blur(bucket, r.request_id), self.accuracy, cap)

    def blur(self, bucket: int, request_id: str) -> int:
        """``bucket``, or with probability ``1 - accuracy`` a wrong bucket within range."""
        rng = random.Random(f"{self.seed}/{request_id}")
        if rng.random() < self.accuracy:
            return bucket
        last = self.buckets.num_buckets - 1
        choices = [(k, w) for k, w in self.offsets.items() if 0 <= bucket + k <= last]
        if not choices:
            return bucket
        ks, ws = zip(*choices)
        return bucket + rng.choices(ks, ws)[0]


DEFAULT_CONFUSION = Path(__file__).resolve().parent / "data" / "confusion_sklearn_g200.json"


def shipped_accuracy(path=DEFAULT_CONFUSION) -> float:
    """The measured bucket accuracy the confusion file records (default: the shipped ``sklearn``
    backend's at granularity 200 on 2,072 held-out prompts, 65.7%): what a simulation's default
    predictor is set to, so a simulated replay's predictor is as right as the one a server runs."""
    try:
        data = json.loads(Path(path).read_text())
        return float(data["accuracy"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the measured accuracy from {str(path)!r}: {e}") from None


def _read_confusion(path) -> list[list[int]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"field 'confusion': cannot read {str(path)!r}: {e}") from None
    matrix = data["confusion"] if isinstance(data, dict) else data
    if not matrix or any(len(row) != len(matrix) for row in matrix):
        raise ValueError(f"field 'confusion': {path} needs a square [true][predicted] count matrix")
    return matrix


def error_offsets(confusion: list[list[int]]) -> dict[int, float]:
    """How far off the wrong predictions of a confusion matrix are: {predicted - true: share}."""
    counts: dict[int, float] = {}
    for t, row in enumerate(confusion):
        for p, n in enumerate(row):
            if p != t and n:
                counts[p - t] = counts.get(p - t, 0) + n
    total = sum(counts.values())
    if not total:
        return {-1: 0.5, 1: 0.5}  # a matrix with no errors: a neighbour either way
    return {k: v / total for k, v in sorted(counts.items())}