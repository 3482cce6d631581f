"""Which length predictor a run uses when ``--predictor`` is not given, and why.

``oracle`` has no true length for an API request: every prediction would fall back (counted as
``unknown``), so the scheduler would run length-blind while the start-up said it had an oracle.
``serve`` therefore defaults to a backend that predicts from the request alone,
``SERVE_PREDICTOR``, and says at start-up which one serves and why. Where it cannot (no trained
artefact and no label or prompt file to fit one), it serves with ``none`` and says how to fix
that, rather than failing to start.

A replay and ``bench goodput`` run what ``serve`` runs (issue 54: a trace knows every length, but
a served request does not, so a replay that handed the oracle to tetri and adaptive measured a
server nobody can run); on a simulated device, which runs no predictor backend, the default is
``accuracy`` at the shipped backend's measured accuracy (``default_predictor``). ``oracle`` only
when asked for, and each system's predictor is named in the replay's table.
"""
from __future__ import annotations

import argparse
from pathlib import Path

# The backend with the best measured share of the oracle's scheduling gain (issue 25, target 1:
# 'aserve predictor share', docs/notes/predictors.md, "Overrun predictions held to max_tokens", ten
# seeds): under reserve-dynamic sklearn 113%, lm 103%, retrieval 43% (standard error 7-9 points).
# sklearn leads, and it also fits in 3 s where lm's first fit takes about 11 minutes; in serve's
# default mode (coupled) no prediction is read and lm could not take its features from a prefill,
# so it would run its 16-layer backbone on every request for nothing.
SERVE_PREDICTOR = "sklearn"
WHY = ("serve's default (SERVE_PREDICTOR, aserve/commands/serve_predictor.py): it predicts from the request "
       "alone (oracle has no true length for an API request), and has the best measured share of the oracle's "
       "scheduling gain, 113% over ten seeds (docs/notes/predictors.md, issue 25)")


def default_predictor(a: argparse.Namespace, options: dict) -> tuple[str, dict, str]:
    """``(backend, options, why)`` for a run's flags ``a``: ``--predictor`` when given; on a
    ``sim:`` device the set-accuracy predictor at ``SERVE_PREDICTOR``'s measured accuracy (unless
    ``--predictor-option accuracy=P`` sets it); elsewhere what ``serve`` runs."""
    if a.predictor is not None:
        return a.predictor, options, "--predictor"
    if a.device.startswith("sim:"):
        from predictors.simple import DEFAULT_CONFUSION, shipped_accuracy

        accuracy = options.get("accuracy", shipped_accuracy())
        return "accuracy", {**options, "accuracy": accuracy}, (
            f"a simulation's default: the true length's bucket with probability {accuracy:.1%}, the shipped "
            f"{SERVE_PREDICTOR!r} backend's measured accuracy at g 200 ({DEFAULT_CONFUSION.name}), its errors "
            "drawn as that backend errs")
    name, why = serve_predictor(a, options)
    return name, options, why


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

