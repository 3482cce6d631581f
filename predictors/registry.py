"""Names to predictor backends, as configs and the CLI spell them.

Backends are imported on first use: asking for ``none`` must not load torch, and asking for
``sklearn`` must not load transformers.
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from predictors.base import LengthPredictor, read_meta

# name -> (module, class)
BACKENDS = {
    "none": ("predictors.simple", "NonePredictor"),
    "oracle": ("predictors.simple", "OraclePredictor"),
    "sklearn": ("predictors.sklearn_backend", "SklearnPredictor"),
    "lm": ("predictors.lm_backend", "LMPredictor"),
    "retrieval": ("predictors.retrieval_backend", "RetrievalPredictor"),
    "accuracy": ("predictors.simple", "SetAccuracyPredictor"),  # simulations: the true bucket at a set accuracy
}


def predictor_class(name: str) -> type[LengthPredictor]:
    if name not in BACKENDS:
        raise ValueError(f"unknown length predictor {name!r}; valid names: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def get_predictor(name: str, **kw) -> LengthPredictor:
    """A new, untrained predictor: ``get_predictor("sklearn", granularity=100)``."""
    cls = predictor_class(name)
    try:
        return cls(**kw)
    except TypeError as e:  # an unknown keyword: name the backend and what it takes
        params = inspect.signature(cls.__init__).parameters
        known = [k for k in params if k not in ("self", "granularity", "max_length")]
        raise ValueError(f"bad options for the {name!r} predictor: {e}; its options: "
                         f"{', '.join(known) or 'none'}") from None


def load_predictor(path: Path | str, **overrides) -> LengthPredictor:
    """A trained predictor from the folder ``LengthPredictor.save`` wrote (its backend is in meta.json);
    ``overrides`` replace saved settings, e.g. ``device="cpu"`` for a model trained on a GPU."""
    return predictor_class(read_meta(path)["backend"]).load(path, **overrides)
