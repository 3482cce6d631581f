"""Training a predictor on the train split of a label file, and where its artefact lives.

Artefacts go under the cache dir (``~/.cache/aserve/predictors/`` unless ``XDG_CACHE_HOME``
says otherwise), one folder per backend, granularity and label file::

    <cache>/<backend>-g<granularity>-<label file stem>-<sha1 of its bytes, 8 hex>[-<options hash>]/meta.json

so a retrained label file never meets a stale model, and ``evaluate`` finds what ``train``
made. Training uses the train side of the id split only, unless ``use_all`` (a model to
deploy rather than to measure).
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from predictors.base import DEFAULT_MAX_LENGTH, META_FILE, LengthPredictor
from predictors.dataset import (DEFAULT_LABELS, DEFAULT_PROMPTS, TEST_FRACTION, Example, join_examples,
                                load_prompts, read_labels, require_file, split_by_id)
from predictors.samples import check_targets, training_rows


def default_cache_dir() -> Path:
    from model.loader import default_cache_dir as aserve_cache

    return aserve_cache() / "predictors"


def file_digest(path: Path | str) -> str:
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()[:8]


def artefact_dir(backend: str, granularity: int, labels: Path | str, options: Optional[dict] = None,
                 cache_dir: Optional[Path] = None, targets: str = "median") -> Path:
    """Where ``train`` saves and ``evaluate`` looks; backend options, if any, get a folder of their
    own, and so do training targets other than the median (``-t<targets>``)."""
    labels = Path(labels)
    name = f"{backend}-g{granularity}-{labels.stem}-{file_digest(labels)}"
    if options:
        name += "-" + hashlib.sha1(json.dumps(options, sort_keys=True).encode()).hexdigest()[:6]
    if targets != "median":
        name += f"-t{targets}"
    return Path(cache_dir or default_cache_dir()) / name


@dataclass(frozen=True)
class TrainConfig:
    """One training run: which backend, which granularity, which data, where the result goes."""

    backend: str
    granularity: int = 200
    labels: Path = DEFAULT_LABELS
    prompts: Path = DEFAULT_PROMPTS
    out: Optional[Path] = None  # default: artefact_dir(...)
    test_fraction: float = TEST_FRACTION
    use_all: bool = False
    options: dict = field(default_factory=dict)  # backend keyword arguments
    targets: str = "median"  # median | samples | mode: what a prompt's samples become (predictors/samples.py)

    def __post_init__(self):
        from predictors.registry import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(f"unknown length predictor {self.backend!r} (field 'backend'); "
                             f"valid: {', '.join(BACKENDS)}")
        if not isinstance(self.granularity, int) or self.granularity < 1:
            raise ValueError(f"field 'granularity' must be an integer >= 1, got {self.granularity!r}")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"field 'test_fraction' must be in (0, 1), got {self.test_fraction}")
        check_targets(self.targets)


@dataclass(frozen=True)
class Dataset:
    """Labelled examples split by id, with the labeller's length cap."""

    train: list[Example]
    test: list[Example]
    max_length: int
    labels_path: Path


def load_dataset(prompts: Path | str, labels: Path | str, test_fraction: float = TEST_FRACTION) -> Dataset:
    require_file("prompts", prompts)
    require_file("labels", labels)
    label_rows = read_labels(labels)
    if not label_rows:
        raise ValueError(f"field 'labels': {labels} holds no labels")
    caps = [lab.max_tokens for lab in label_rows if lab.max_tokens]
    examples = join_examples(load_prompts(prompts), label_rows)
    train, test = split_by_id(examples, test_fraction)
    return Dataset(train, test, max(caps) if caps else DEFAULT_MAX_LENGTH, Path(labels))


def build_predictor(backend: str, granularity: int, max_length: int, options: Optional[dict] = None) -> LengthPredictor:
    from predictors.registry import get_predictor

    return get_predictor(backend, granularity=granularity, max_length=max_length, **(options or {}))


def train_predictor(cfg: TrainConfig, data: Optional[Dataset] = None) -> tuple[LengthPredictor, Path, dict]:
    """Fit ``cfg.backend`` on the train split (or everything) and save it; returns (predictor, folder, summary)."""
    data = data or load_dataset(cfg.prompts, cfg.labels, cfg.test_fraction)
    prompts = data.train + data.test if cfg.use_all else data.train
    if not prompts:
        raise ValueError(f"field 'labels': no training rows in {data.labels_path} after the split")
    predictor = build_predictor(cfg.backend, cfg.granularity, data.max_length, cfg.options)
    rows = training_rows(prompts, cfg.targets, predictor.buckets)
    out = Path(cfg.out) if cfg.out else artefact_dir(cfg.backend, cfg.granularity, data.labels_path, cfg.options,
                                                     targets=cfg.targets)
    side = "every prompt" if cfg.use_all else "the train split"
    say(f"fitting the {cfg.backend} length predictor (granularity {cfg.granularity}) on {len(prompts)} prompts, "
        f"{side} of {data.labels_path} ({len(rows)} rows, targets: {cfg.targets}); it will be saved to {out}")
    start = time.perf_counter()
    predictor.fit(rows)
    seconds = time.perf_counter() - start
    predictor.save(out)
    say(f"fitted the {cfg.backend} length predictor in {seconds:.1f} s; saved to {out}")
    summary = {"backend": cfg.backend, "granularity": cfg.granularity, "n_train": len(prompts),
               "n_rows": len(rows), "targets": cfg.targets,
               "n_test_held_out": 0 if cfg.use_all else len(data.test), "max_length": data.max_length,
               "fit_seconds": round(seconds, 2), "labels": str(data.labels_path),
               "labels_sha1": file_digest(data.labels_path), "options": cfg.options, "path": str(out)}
    _add_to_meta(out, {"training": summary})
    return predictor, out, summary


SERVING_BACKENDS = ("sklearn", "lm", "retrieval")  # the backends a server fits on first use


def prepare(backends, granularities, labels: Path | str = DEFAULT_LABELS, prompts: Path | str = DEFAULT_PROMPTS,
            options: Optional[dict] = None) -> list[dict]:
    """Train ahead what a server would otherwise fit on its first request (``aserve predictor
    prepare``, ``make predictors``): each backend at each granularity, on the train split, saved
    where ``serving.load_for_serving`` looks. Artefacts already there are left alone. One row per
    pair: backend, granularity, path, and ``"present"`` or the seconds the fit took."""
    from predictors.registry import predictor_class

    rows, data = [], None
    for backend in backends:
        if not predictor_class(backend).needs_fit:
            raise ValueError(f"field 'backends': {backend!r} needs no training")
        for g in granularities:
            out = artefact_dir(backend, g, labels, options)
            if (out / META_FILE).is_file():
                say(f"{backend} at granularity {g}: already trained, at {out}")
                rows.append({"backend": backend, "granularity": g, "path": str(out), "fit_seconds": "present"})
                continue
            data = data or load_dataset(prompts, labels)
            _, _, summary = train_predictor(TrainConfig(backend, g, Path(labels), Path(prompts), out,
                                                        options=dict(options or {})), data)
            rows.append({"backend": backend, "granularity": g, "path": str(out), "fit_seconds": summary["fit_seconds"]})
    return rows


def say(message: str) -> None:
    """One line on stderr: what a fit is doing and where its result goes (never a silent minute)."""
    print(f"aserve: {message}", file=sys.stderr, flush=True)


def _add_to_meta(folder: Path, extra: dict) -> None:
    meta_path = folder / META_FILE
    meta = json.loads(meta_path.read_text())
    meta.update(extra)
    meta_path.write_text(json.dumps(meta, indent=1))
