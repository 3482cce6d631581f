"""Scoring a backend on the test split, at the paper's three granularities.

Output (``aserve predictor eval --json FILE``)::

    {"backend": "sklearn", "labels": ..., "max_length": 1024, "n_train": ..., "granularities": {
       "100": {"accuracy", "majority_accuracy", "within_one_bucket", "mae_tokens",
               "latency_ms_p50", "latency_ms_p99", "cpu_ms_p50", "batch_size", "latency_ms_batch",
               "latency_ms_per_request_batched", "memory_mb", "rss_delta_mb", "n", "trained"}, ...}}

- ``accuracy``: predicted bucket == true bucket (the paper's metric); ``confusion``: the counts
  of each (true, predicted) bucket pair (the set-accuracy predictor draws its errors from it).
- ``majority_accuracy``: always answering the most common *training* bucket.
- ``mae_tokens``: |predicted bucket midpoint - true length| (the last bucket's midpoint is
  taken between its start and the label cap).
- ``online_accuracy`` (backends that learn online): the test set in arrival order, each chunk
  of 16 observed with its true length before the next is predicted.
- latencies: one request at a time (p50/p99 over up to ``latency_samples`` requests), then
  batches of ``batch_size`` (``latency_ms_batch``: median per batch); the predictor runs in
  the caller's thread with ``threads`` torch threads (1 by default, as beside the server's
  main model). ``cpu_ms_p50``: the calling thread's CPU time per single prediction, which
  stays honest when other work shares the cores (wall time then includes waiting for one).
  ``none`` answers the full range, reported as the last bucket.
- ``from_prefill_latency_ms_p50/p99`` (``lm`` on the default model): one prediction when the
  served prefill hands the predictor its backbone's features (the head alone; the server does
  this for chat requests, aserve/predict/online.py).
- ``memory_mb``: what the predictor holds (weights, vectorisers, index), not the process;
  ``rss_delta_mb``: the process's resident-set growth while loading and warming it up.
- ``prefill_overlap`` (top level, when a ``prefill_overlap`` measurement is given; measured once,
  at granularity 200 or the first one asked): what ``prefill_overlap(predictor, requests)``
  returns; the server's command passes the served model's prefill of a 512-token chunk timed
  alone and while the predictor predicts non-stop on another thread (aserve/predict/overlap.py).
  Null for backends that answer inline (``none``, ``oracle``), which the server runs on no thread.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from predictors.base import GRANULARITIES, Buckets, LengthPredictor, bucket_match
from predictors.dataset import DEFAULT_LABELS, DEFAULT_PROMPTS, TEST_FRACTION, Example
from predictors.simple import ORACLE_ATTR
from predictors.train import (Dataset, TrainConfig, artefact_dir, build_predictor, file_digest, load_dataset,
                              train_predictor)
from scheduling.request import Request, SamplingParams


def to_requests(examples: Sequence[Example], max_tokens: int) -> list[Request]:
    """Requests as the server would hold them. Predictors read ``prompt_text`` and the served
    model's token *count*; the ids themselves are placeholders of the right length. The true
    length rides along as ``oracle_length`` for the oracle."""
    out = []
    for e in examples:
        r = Request(e.id, [0] * e.prompt_tokens, SamplingParams(max_tokens=max_tokens), prompt_text=e.prompt)
        setattr(r, ORACLE_ATTR, e.length)
        out.append(r)
    return out


def _rss_mb() -> float:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return 0.0


def obtain_predictor(backend: str, granularity: int, data: Dataset, model_dir: Optional[Path],
                     retrain: bool, options: Optional[dict], targets: str = "median") -> tuple[LengthPredictor, str]:
    """A trained predictor: loaded from its artefact folder when there, else fitted (and saved)."""
    from predictors.registry import load_predictor

    predictor = build_predictor(backend, granularity, data.max_length, options)
    if not predictor.needs_fit:
        return predictor.fit(data.train), "none needed"
    folder = (Path(model_dir) / f"g{granularity}" if model_dir
              else artefact_dir(backend, granularity, data.labels_path, options, targets=targets))
    if not retrain and (folder / "meta.json").is_file():
        meta = json.loads((folder / "meta.json").read_text()).get("training", {})
        # only a model of this backend, granularity, labels and options, trained with the test
        # split held out, counts as already trained
        same = (meta.get("backend") == backend and meta.get("granularity") == granularity
                and meta.get("labels_sha1") == file_digest(data.labels_path)
                and meta.get("options", {}) == (options or {}) and meta.get("n_test_held_out", 0) > 0
                and meta.get("targets", "median") == targets)
        if same:
            return load_predictor(folder), f"loaded {folder}"
    cfg = TrainConfig(backend, granularity, data.labels_path, out=folder, options=options or {}, targets=targets)
    predictor, _, summary = train_predictor(cfg, data)
    return predictor, f"fitted in {summary['fit_seconds']} s, saved to {folder}"


def latency_ms(predictor: LengthPredictor, requests: Sequence[Request], batch_size: int,
               samples: int) -> dict:
    predictor.predict(requests[:2])  # warm-up: lazy loads, first-call allocations
    single, cpu = [], []
    for r in requests[:samples]:
        start, start_cpu = time.perf_counter(), time.thread_time()
        predictor.predict([r])
        single.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.thread_time() - start_cpu) * 1e3)
    batches = []
    timed = requests[:batch_size * max(1, samples // 4)]  # enough batches for a median, not the whole set again
    for i in range(0, len(timed), batch_size):
        start = time.perf_counter()
        predictor.predict(timed[i:i + batch_size])
        batches.append((time.perf_counter() - start) * 1e3)
    return {"latency_ms_p50": round(float(np.percentile(single, 50)), 3),
            "latency_ms_p99": round(float(np.percentile(single, 99)), 3),
            "cpu_ms_p50": round(float(np.percentile(cpu, 50)), 3), "batch_size": batch_size,
            "latency_ms_batch": round(float(np.median(batches)), 3),
            "latency_ms_per_request_batched": round(float(sum(batches) / len(timed)), 3)}


def from_prefill_latency_ms(predictor: LengthPredictor, requests: Sequence[Request], samples: int) -> dict:
    """For a backend whose backbone is the served (default) model's first layers (``lm``): the
    time per prediction when the served prefill hands it the features (the server's ``prefill
    features`` path: the head alone, one request at a time, on the backbone's real features of
    up to ``samples`` test prompts). Empty for other backends."""
    from model.loader import DEFAULT_MODEL, resolve_model

    if type(predictor).feature_layer is LengthPredictor.feature_layer:  # never: no model to resolve
        return {}
    if not predictor.feature_layer(DEFAULT_MODEL, resolve_model(DEFAULT_MODEL)):
        return {}
    timed = list(requests[:samples])
    feats = predictor.backbone_features(timed)
    predictor.predict_features(feats[:1], timed[:1])  # warm-up
    single = []
    for i, r in enumerate(timed):
        start = time.perf_counter()
        predictor.predict_features(feats[i:i + 1], [r])
        single.append((time.perf_counter() - start) * 1e3)
    return {"from_prefill_latency_ms_p50": round(float(np.percentile(single, 50)), 3),
            "from_prefill_latency_ms_p99": round(float(np.percentile(single, 99)), 3)}


def score(predictor: LengthPredictor, test: Sequence[Example], train: Sequence[Example], buckets: Buckets,
          requests: Optional[Sequence[Request]] = None) -> dict:
    """Accuracy, the majority baseline, within-one-bucket accuracy and MAE over the test rows
    (``requests``: ``to_requests`` of them, when the caller has it already)."""
    requests = requests if requests is not None else to_requests(test, buckets.max_length)
    ranges = []
    for i in range(0, len(requests), 64):
        ranges.extend(predictor.predict(requests[i:i + 64]))
    truth = buckets.bucket_array([e.length for e in test])
    pred = np.array([r.bucket for r in ranges])
    majority = Counter(buckets.bucket_array([e.length for e in train]).tolist()).most_common(1)[0][0]
    mids = np.array([buckets.midpoint(int(b)) for b in pred])
    same, near = bucket_match(pred, truth)
    confusion = np.zeros((buckets.num_buckets, buckets.num_buckets), dtype=int)
    np.add.at(confusion, (truth, pred), 1)
    return {"accuracy": same,
            "confusion": confusion.tolist(),  # [true bucket][predicted bucket] counts
            "majority_accuracy": round(float((truth == majority).mean()), 4),
            "majority_bucket": int(majority),
            "within_one_bucket": near,
            "mae_tokens": round(float(np.abs(mids - np.array([e.length for e in test])).mean()), 1),
            "n": len(test)}


def online_accuracy(predictor: LengthPredictor, test: Sequence[Example], chunk: int = 16) -> float:
    """Accuracy when every finished request is observed before the next chunk is predicted:
    what an online learner gains from its own traffic. Mutates the predictor."""
    requests, hits = to_requests(test, predictor.buckets.max_length), 0
    for i in range(0, len(requests), chunk):
        part = requests[i:i + chunk]
        for req, rng, ex in zip(part, predictor.predict(part), test[i:i + chunk]):
            hits += rng.bucket == predictor.buckets.bucket_of(ex.length)
            predictor.observe(req, ex.length)
    return round(hits / max(1, len(requests)), 4)


def evaluate_backend(backend: str, prompts: Path | str = DEFAULT_PROMPTS, labels: Path | str = DEFAULT_LABELS,
                     granularities: Sequence[int] = GRANULARITIES, model_dir: Optional[Path] = None,
                     retrain: bool = False, options: Optional[dict] = None, test_fraction: float = TEST_FRACTION,
                     batch_size: int = 32, latency_samples: int = 200, threads: int = 1,
                     prefill_overlap: Optional[Callable] = None) -> dict:
    """Train (or load) and score ``backend`` at each granularity; the eval JSON as a dict.

    ``threads``: torch threads while measuring. One by default, as in the server, where the
    predictor has a thread of its own beside the main model (``parallel`` mode).
    """
    with _torch_threads(threads):
        return _evaluate(backend, prompts, labels, granularities, model_dir, retrain, options, test_fraction,
                         batch_size, latency_samples, prefill_overlap)


def _evaluate(backend, prompts, labels, granularities, model_dir, retrain, options, test_fraction,
              batch_size, latency_samples, prefill_overlap) -> dict:
    data = load_dataset(prompts, labels, test_fraction)
    if not data.test or not data.train:
        raise ValueError(f"field 'labels': {labels} has too few rows for a train/test split "
                         f"({len(data.train)} train, {len(data.test)} test)")
    report = {"backend": backend, "labels": str(labels), "max_length": data.max_length, "n_train": len(data.train),
              "n_test": len(data.test), "torch_threads": _torch_threads_now(), "granularities": {},
              "prefill_overlap": None}
    overlap_g = 200 if 200 in granularities else granularities[0]
    requests = to_requests(data.test, data.max_length)  # read, never changed, by every measurement below
    for g in granularities:
        rss0 = _rss_mb()
        predictor, how = obtain_predictor(backend, g, data, model_dir, retrain, options)
        stats = getattr(predictor, "stats", None)
        if stats is not None:
            stats.update((k, 0) for k in stats)
        row = score(predictor, data.test, data.train, predictor.buckets, requests)
        if stats is not None:
            row["answers"] = dict(stats)  # e.g. retrieval: neighbours vs MLP fallback, over the test set
        row.update(latency_ms(predictor, requests, batch_size, latency_samples))
        row.update(from_prefill_latency_ms(predictor, requests, latency_samples))
        row["memory_mb"] = round(predictor.memory_bytes() / 2**20, 2)
        row["rss_delta_mb"] = round(_rss_mb() - rss0, 1)
        row["trained"] = how
        if prefill_overlap is not None and g == overlap_g and not predictor.inline:
            report["prefill_overlap"] = prefill_overlap(predictor, requests)
        if predictor.learns_online:  # last: it grows the predictor's state
            row["online_accuracy"] = online_accuracy(predictor, data.test)
        report["granularities"][str(g)] = row
        predictor.close()
    return report


def _torch_threads_now() -> int:
    import torch

    return torch.get_num_threads()


@contextlib.contextmanager
def _torch_threads(n: int):
    import torch

    if n < 1:
        raise ValueError(f"field 'threads' must be >= 1, got {n}")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
