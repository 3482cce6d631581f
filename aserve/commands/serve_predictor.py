"""Which length predictor ``aserve serve`` runs when ``--predictor`` is not given, and why.

``oracle`` (the replays' default: a trace knows every length) has no true length for an API
request: every prediction would fall back (counted as ``unknown``), so the scheduler would run
length-blind while the start-up said it had an oracle. ``serve`` therefore defaults to a backend
that predicts from the request alone, ``SERVE_PREDICTOR``, and says at start-up which one serves
and why. Where it cannot (no trained artefact and no label or prompt file to fit one), it serves
with ``none`` and says how to fix that, rather than failing to start.
"""
from __future__ import annotations

import argparse
from pathlib import Path

# The backend with the best measured share of the oracle's scheduling gain (issue 25, target 1:
# 'aserve predictor share', docs/BENCHMARKS.md, "Overrun predictions held to max_tokens", ten
# seeds): under reserve-dynamic sklearn 113%, lm 103%, retrieval 43% (standard error 7-9 points).
# sklearn leads, and it also fits in 3 s where lm's first fit takes about 11 minutes; in serve's
# default mode (coupled) no prediction is read and lm could not take its features from a prefill,
# so it would run its 16-layer backbone on every request for nothing.
SERVE_PREDICTOR = "sklearn"
WHY = ("serve's default (SERVE_PREDICTOR, aserve/commands/serve_predictor.py): it predicts from the request "
       "alone (oracle has no true length for an API request), and has the best measured share of the oracle's "
       "scheduling gain, 113% over ten seeds (docs/BENCHMARKS.md, issue 25)")


def serve_predictor(a: argparse.Namespace, options: dict) -> tuple[str, str]:
    """``(backend, why)`` for ``serve``'s flags ``a`` (``options``: its parsed --predictor-option):
    ``--predictor`` when given, else the default when it can load or fit here, else ``none``."""
    if a.predictor is not None:
        return a.predictor, "--predictor"
    missing = _cannot_load(SERVE_PREDICTOR, a, options)
    if missing:
        return "none", (f"serve's default {SERVE_PREDICTOR!r} has no trained artefact and cannot fit one ({missing}); "
                        f"serving without length predictions: run 'aserve predictor prepare --backends "
                        f"{SERVE_PREDICTOR}' or pass --predictor")
    return SERVE_PREDICTOR, WHY


def _cannot_load(name: str, a: argparse.Namespace, options: dict) -> str:
    """Why ``name`` can neither be loaded nor fitted with these flags ('' when it can)."""
    from predictors.base import META_FILE
    from predictors.dataset import DEFAULT_LABELS, DEFAULT_PROMPTS
    from predictors.registry import predictor_class
    from predictors.train import artefact_dir

    if a.predictor_path or not predictor_class(name).needs_fit:
        return ""
    labels = Path(a.predictor_labels or DEFAULT_LABELS)
    prompts = Path(a.predictor_prompts or DEFAULT_PROMPTS)
    if labels.is_file():
        if (artefact_dir(name, a.predictor_granularity, labels, options) / META_FILE).is_file():
            return ""  # trained ahead ('aserve predictor prepare') or on an earlier start
    return ", ".join(f"no {what} file {str(p)!r}" for what, p in (("labels", labels), ("prompts", prompts))
                     if not p.is_file())  # both there: it fits at start-up, with progress
