"""The predictor a server runs, and what it sees of a request.

``load_for_serving`` finds the backend a cluster uses (an artefact given, the one
``aserve predictor train`` caches, or one fitted now and cached); ``prompt_view`` is the request
as a backend sees it (text clipped; decoded from the ids when the request has none). The online
machinery around them (batching, timeouts, scoring) is ``aserve/predict/online.py``.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

from predictors.base import META_FILE, LengthPredictor, clip_text, read_meta
from predictors.dataset import DEFAULT_LABELS, DEFAULT_PROMPTS
from predictors.registry import get_predictor, load_predictor, predictor_class
from predictors.simple import ORACLE_ATTR
from predictors.train import say
from scheduling.request import Request

MAX_DECODE_IDS = 4096  # a request without text: decode its first and last 2048 ids only
_CHATML_USER = re.compile(r"<\|im_start\|>user\n(.*?)(?:<\|im_end\|>|$)", re.S)


def prompt_view(req: Request, decode: Optional[Callable[[list[int]], str]]) -> Request:
    """The request as the backend sees it: its prompt text clipped to what every backend takes.

    A request submitted as token ids (replay, chat over the API) has no text: its ids are decoded
    (head and tail only), and of a ChatML prompt (the default model's template) only the last
    user turn is kept, which is what the predictors were trained on."""
    text = req.prompt_text
    if not text.strip() and decode is not None:
        ids = req.prompt_token_ids
        if len(ids) > MAX_DECODE_IDS:
            ids = ids[:MAX_DECODE_IDS // 2] + ids[-MAX_DECODE_IDS // 2:]
        text = decode(ids)
        turns = _CHATML_USER.findall(text)
        text = turns[-1] if turns else text
    view = Request(req.request_id, req.prompt_token_ids, req.sampling, prompt_text=clip_text(text))
    if getattr(req, ORACLE_ATTR, None) is not None:
        setattr(view, ORACLE_ATTR, getattr(req, ORACLE_ATTR))
    return view


def load_for_serving(name: str, granularity: int = 200, options: Optional[dict] = None, path=None,
                     labels=None, prompts=None) -> Optional[LengthPredictor]:
    """The backend ``name``, ready to predict (seconds: keep it off an event loop).

    ``none`` is None. Otherwise, first found: the artefact at ``path``; the one ``aserve predictor
    train`` caches for this backend, granularity, label file and options; a new one fitted now on
    the label file's train split and saved there (logged, with progress). ``labels`` and
    ``prompts`` default to the committed label set and the shared prompt pool."""
    options = dict(options or {})
    if name == "none":
        return None
    if path:
        return _load(Path(path), name, granularity, options)
    if not predictor_class(name).needs_fit:
        return get_predictor(name, granularity=granularity, **options)
    from predictors.train import artefact_dir

    labels, prompts = _data_files(name, labels, prompts)
    cached = artefact_dir(name, granularity, labels, options)
    if (cached / META_FILE).is_file():
        return _load(cached, name, granularity, options)
    return _fit(name, granularity, labels, prompts, options, cached)


def _load(path: Path, name: str, granularity: int, options: dict) -> LengthPredictor:
    meta = read_meta(path)
    if meta["backend"] != name:
        raise ValueError(f"{path} holds a {meta['backend']!r} predictor, not {name!r}: "
                         f"pass --predictor {meta['backend']}")
    trained_g = meta["config"].get("granularity")
    if trained_g != granularity:
        raise ValueError(f"{path} was trained at granularity {trained_g}, not {granularity}: "
                         f"pass --predictor-granularity {trained_g}")
    backend = load_predictor(path, **options)
    say(f"length predictor {name} (granularity {trained_g}) loaded from {path}")
    return backend


def _data_files(name: str, labels, prompts) -> tuple[Path, Path]:
    labels, prompts = Path(labels or DEFAULT_LABELS), Path(prompts or DEFAULT_PROMPTS)
    missing = [f"{what} file {str(p)!r}" for what, p in (("labels", labels), ("prompts", prompts)) if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"the {name!r} predictor has no trained artefact and cannot fit one: no {' and no '.join(missing)} "
            f"(make labels with 'aserve label', or pass --predictor-path DIR, --predictor-labels, --predictor-prompts)")
    return labels, prompts


def _fit(name: str, granularity: int, labels: Path, prompts: Path, options: dict, out: Path) -> LengthPredictor:
    """Fit now (``train_predictor`` says what on, where it goes, and shows the backbone pass's
    progress with an ETA); ``aserve predictor prepare`` does this ahead of time."""
    from predictors.train import TrainConfig, load_dataset, train_predictor

    say(f"length predictor {name}: no trained artefact for granularity {granularity} and {labels.name} "
         f"(train it ahead with 'aserve predictor prepare --backends {name}'); fitting one now, once")
    data = load_dataset(prompts, labels)
    backend, _, _ = train_predictor(TrainConfig(name, granularity, labels, prompts, out=out, options=options), data)
    return backend
