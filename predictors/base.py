"""The length-predictor protocol, length buckets, and what every backend shares.

A predictor answers with a *range*, never a number (TetriInfer §3.3.2): the output length of
a request falls in a bucket of a chosen granularity ``g``::

    bucket:   0          1           2                 K-1 (last, open-ended)
            [0, g)    [g, 2g)    [2g, 3g)   ...   [(K-1)g, max_tokens + 1)

``K = ceil(max_length / g)`` where ``max_length`` is the labeller's cap (1024 by default): a
label equal to the cap only says "at least this long", so the last bucket runs up to the
request's own ``max_tokens`` (inclusive). ``LengthRange.prob`` is the predictor's probability
of the bucket it names; ``none`` and ``oracle`` say 1.0.

Backends read a request's ``prompt_text`` (their own tokenizer, their own length limit:
longer prompts are truncated for the predictor only) and ``num_prompt_tokens`` (the served
model's count). Training rows are ``predictors.dataset.Example``; both kinds go through
``prompt_of``.
"""
from __future__ import annotations

import abc
import json
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from predictors.dataset import Example
from scheduling.request import LengthRange, Request

GRANULARITIES = (100, 200, 400)  # the paper's three
MODES = ("parallel", "sequential")
DEFAULT_MAX_LENGTH = 1024
META_FILE = "meta.json"
MAX_PROMPT_CHARS = 16_000  # longer prompt texts: head and tail only (bounds the latency; the pool's longest is ~9.8k)

Item = Union[Request, Example]


@dataclass(frozen=True)
class Buckets:
    """Maps output lengths to buckets ``[k*g, (k+1)*g)``; the last one is open-ended."""

    granularity: int = 200
    max_length: int = DEFAULT_MAX_LENGTH

    def __post_init__(self):
        if not isinstance(self.granularity, int) or self.granularity < 1:
            raise ValueError(f"granularity must be an integer >= 1, got {self.granularity!r}")
        if not isinstance(self.max_length, int) or self.max_length < 1:
            raise ValueError(f"max_length must be an integer >= 1, got {self.max_length!r}")

    @property
    def num_buckets(self) -> int:
        return max(1, math.ceil(self.max_length / self.granularity))

    def bucket_of(self, length: int) -> int:
        if length < 0:
            raise ValueError(f"a length must be >= 0, got {length}")
        return min(int(length) // self.granularity, self.num_buckets - 1)

    def bucket_array(self, lengths) -> np.ndarray:
        """``bucket_of`` over an array of lengths."""
        return np.minimum(np.asarray(lengths, dtype=np.int64) // self.granularity, self.num_buckets - 1)

    def bounds(self, bucket: int, max_tokens: int | None = None) -> tuple[int, int]:
        """``[lo, hi)`` of a bucket; the last one ends after ``max_tokens`` (default ``max_length``)."""
        if not 0 <= bucket < self.num_buckets:
            raise ValueError(f"bucket {bucket} out of range 0..{self.num_buckets - 1}")
        lo = bucket * self.granularity
        top = max(max_tokens or self.max_length, self.max_length) + 1
        hi = top if bucket == self.num_buckets - 1 else (bucket + 1) * self.granularity
        return lo, hi

    def midpoint(self, bucket: int) -> float:
        """The bucket's middle; the last bucket's middle is taken between its start and ``max_length``."""
        lo, hi = self.bounds(bucket)
        return (lo + min(hi - 1, self.max_length)) / 2

    def to_range(self, bucket: int, prob: float, max_tokens: int | None = None) -> LengthRange:
        """The ``LengthRange`` for a predicted bucket, clipped to what ``max_tokens`` allows.

        A request cannot outlive its ``max_tokens``: a bucket that starts beyond it is replaced
        by the bucket holding ``max_tokens`` itself, and ``hi`` never exceeds ``max_tokens + 1``.
        """
        if max_tokens is not None and bucket * self.granularity > max_tokens:
            bucket = self.bucket_of(max_tokens)
        lo, hi = self.bounds(bucket, max_tokens)
        if max_tokens is not None:
            hi = min(hi, max_tokens + 1)
        return LengthRange(lo, hi, bucket, float(prob))


def pick(scores: np.ndarray, cover: float | None = None) -> np.ndarray:
    """The column to answer in each row of bucket scores ``[n, K]`` (columns in ascending bucket
    order). ``cover`` None: the most likely bucket. ``cover`` q in (0, 1]: the lowest bucket whose
    cumulative score reaches q, so the length stays under the range's end with probability q by
    the model's own scores: a reservation policy reads that end as the room to hold, and a bucket
    named too low costs it a preemption, one named too high only some concurrency."""
    if cover is None:
        return np.asarray(scores).argmax(axis=1)
    scores = np.asarray(scores, dtype=np.float64)
    total = scores.sum(axis=1, keepdims=True)
    cumulative = np.cumsum(scores / np.where(total > 0, total, 1.0), axis=1)
    return (cumulative >= cover - 1e-9).argmax(axis=1)


def check_cover(cover: float | None) -> None:
    """``cover`` must be None or a probability in (0, 1]."""
    if cover is not None and not 0.0 < cover <= 1.0:
        raise ValueError(f"predictor_cover must be in (0, 1], got {cover}")


def bucket_match(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Over two arrays of bucket indices: the share of rows in the same bucket, and within one
    bucket of each other (rounded to 4 places)."""
    a, b = np.asarray(a), np.asarray(b)
    return round(float((a == b).mean()), 4), round(float((np.abs(a - b) <= 1).mean()), 4)


def prompt_of(item: Item) -> tuple[str, int]:
    """``(prompt text, served-model prompt tokens)`` of a request or a training example."""
    if isinstance(item, Example):
        text, num_tokens, name = item.prompt, item.prompt_tokens, item.id
    else:
        text, num_tokens, name = item.prompt_text, item.num_prompt_tokens, item.request_id
    if not text or not text.strip():
        raise ValueError(f"request {name!r} has an empty prompt_text: a length predictor needs the prompt's text")
    return text, num_tokens


def clip_text(text: str, max_chars: int = MAX_PROMPT_CHARS) -> str:
    """``text`` if short enough, else its head and tail halves (instructions tend to sit at one
    end of a long prompt, the question at the other)."""
    half = max_chars // 2
    return text if len(text) <= max_chars else text[:half] + "\n" + text[-half:]


def max_tokens_of(item: Item) -> int | None:
    return item.sampling.max_tokens if isinstance(item, Request) else None


class LengthPredictor(abc.ABC):
    """Predicts each request's output-length bucket; learns offline (``fit``) and online (``observe``).

    ``predict`` is batched and changes no learned state (retrieval keeps counters and a small
    embedding cache, made safe for it), so it may run on a helper thread beside the main
    model's prefill (``mode = "parallel"``, ``predict_async``); ``observe`` and ``fit`` run on
    the owner's thread only.
    """

    name: str = ""
    needs_fit: bool = True
    learns_online: bool = False  # True when observe() changes later predictions
    inline: bool = False  # True when predicting costs microseconds: callers may skip the helper thread
    _executor: ThreadPoolExecutor | None = None
    # None: answer the most likely bucket; q: the lowest whose cumulative score reaches q (``pick``).
    # A serving choice, not a trained one: set after loading, never saved.
    cover: float | None = None

    def __init__(self, granularity: int = 200, max_length: int = DEFAULT_MAX_LENGTH):
        self.buckets = Buckets(granularity, max_length)
        self.mode = "sequential"

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"predictor mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._mode = mode

    def predict_async(self, requests: Sequence[Item]) -> Future:
        """``predict`` as a future: on the predictor's own thread in ``parallel`` mode (so it overlaps
        the main model's prefill), done inline before returning in ``sequential`` mode."""
        return self.run_async(self.predict, list(requests))

    def run_async(self, fn, *args) -> Future:
        """``fn(*args)`` as a future, on the predictor's own thread in ``parallel`` mode, inline in
        ``sequential`` mode. The online predictor (aserve/predict/online.py) runs ``observe``
        here too, so one thread does all the predictor's work and the two never overlap."""
        if self.mode == "sequential":
            done: Future = Future()
            try:
                done.set_result(fn(*args))
            except Exception as e:  # the caller reads the error from the future, as in parallel mode
                done.set_exception(e)
            return done
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"predictor-{self.name}",
                                                initializer=_one_torch_thread)
        return self._executor.submit(fn, *args)

    def close(self) -> None:
        """Stop the helper thread of ``parallel`` mode (if one was started)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    @property
    def granularity(self) -> int:
        return self.buckets.granularity

    @abc.abstractmethod
    def predict(self, requests: Sequence[Item]) -> list[LengthRange]:
        """One ``LengthRange`` per request, in order."""

    # ---- features from the served model's own prefill (see aserve/predict/online.py) --------------
    def feature_layer(self, served_model: str, served_path: Path | str) -> int:
        """How many layers of the served model (named ``served_model``, its checkpoint folder at
        ``served_path``) yield this predictor's
        features: its backbone is the served model's first layers, so the served prefill can hand
        them over (``predict_features``) instead of the predictor running them again. 0: not so."""
        return 0

    def feature_ids(self, request: Item) -> list[int]:
        """The token ids this predictor's backbone reads for ``request`` (for ``feature_layer``
        predictors): the served prompt's features are its features only when they are these ids."""
        raise NotImplementedError

    def backbone_features(self, requests: Sequence[Item]) -> np.ndarray:
        """The backbone's features [n, hidden] of ``requests``, computed here (what the served
        prefill would hand over; for ``feature_layer`` predictors)."""
        raise NotImplementedError

    def predict_features(self, features: np.ndarray, requests: Sequence[Item]) -> list[LengthRange]:
        """``predict`` from the backbone's features [n, hidden] (for ``feature_layer`` predictors)."""
        raise NotImplementedError

    def observe(self, request: Item, actual_length: int) -> None:
        """A request finished with ``actual_length`` output tokens; online backends learn from it."""

    def fit(self, examples: Sequence[Example]) -> "LengthPredictor":
        """Train on labelled examples; returns self."""
        return self

    def memory_bytes(self) -> int:
        """Bytes held by the predictor's weights, vectorisers and index (not the whole process)."""
        return 0

    # -- persistence: a folder with meta.json plus whatever the backend writes ------------------
    def config(self) -> dict:
        """Constructor keyword arguments that ``load`` passes back."""
        return {"granularity": self.granularity, "max_length": self.buckets.max_length}

    def save(self, path: Path | str) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / META_FILE).write_text(json.dumps({"backend": self.name, "config": self.config()}, indent=1))
        self._save_state(path)
        return path

    @classmethod
    def load(cls, path: Path | str, **overrides) -> "LengthPredictor":
        """A saved predictor; ``overrides`` replace saved settings (e.g. ``device="cpu"``, ``mode``)."""
        meta = read_meta(path)
        if meta["backend"] != cls.name:
            raise ValueError(f"{path} holds a {meta['backend']!r} predictor, not {cls.name!r} (field 'backend')")
        unknown = set(overrides) - set(meta["config"])
        if unknown:
            raise ValueError(f"cannot override {sorted(unknown)} of a {cls.name!r} predictor; "
                             f"settings: {', '.join(meta['config'])}")
        predictor = cls(**{**meta["config"], **overrides})
        predictor._load_state(Path(path))
        return predictor

    def _save_state(self, path: Path) -> None:
        pass

    def _load_state(self, path: Path) -> None:
        pass

    def _check_fitted(self, fitted: bool) -> None:
        if not fitted:
            raise RuntimeError(f"the {self.name!r} predictor is not trained: call fit() or load() first")

    def _fitted_prompts(self, fitted: bool, requests: Sequence[Item]) -> list[tuple[str, int]]:
        """A trained backend's first step of ``predict``: refuse if it is untrained, then each
        request's (prompt text, prompt tokens)."""
        self._check_fitted(fitted)
        return [prompt_of(r) for r in requests]


_POOLS = None  # threadpoolctl's controller, made once the BLAS/OpenMP libraries are loaded


def one_thread():
    """A context that runs numpy/scikit-learn's BLAS and OpenMP pools on one thread.

    On this 2-core machine shared with other work, sklearn's OpenMP threads spin-wait for a
    busy core: LogisticRegression.fit on 300 prompts took 5.2 s of CPU with 2 threads and
    0.11 s with one (measured). A cached controller makes entering this ~20 us.
    """
    global _POOLS
    if _POOLS is None:
        from threadpoolctl import ThreadpoolController

        _POOLS = ThreadpoolController()
    return _POOLS.limit(limits=1)


def _one_torch_thread() -> None:
    # the predictor's thread takes one core: the main model keeps the rest (DESIGN: executors)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


def read_meta(path: Path | str) -> dict:
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"no trained predictor at {str(path)!r} (missing {META_FILE})")
    meta = json.loads(meta_path.read_text())
    for key in ("backend", "config"):
        if key not in meta:
            raise ValueError(f"{meta_path}: missing field {key!r}")
    return meta


def examples_arrays(examples: Sequence[Example], buckets: Buckets) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Texts, prompt token counts and bucket labels of training examples."""
    if not examples:
        raise ValueError("fit needs at least one example")
    texts = [prompt_of(e)[0] for e in examples]
    return texts, np.array([e.prompt_tokens for e in examples]), buckets.bucket_array([e.length for e in examples])
