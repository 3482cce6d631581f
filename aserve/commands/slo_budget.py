"""The SLO as a serving setting (issue 55): what the SLO in force sets in a system's configs.

A chunked system's token budget is sized by Sarathi-Serve's rule (the largest whose step, 32
decodes beside a chunk at the workload's longest context, stays within a step time) at a step
time the SLO gives (``--tbt-slo``):

    gap     the SLO's token-gap limit (a step is one token's gap; else its TPOT): the default of
            every chunked system (sarathi, alise, adaptive)
    tpot    the smaller of its TPOT and token-gap limits (every step within the mean, so TPOT holds
            whatever the mix of steps). Measured worse at the balanced corner (Mixed, paper scale:
            adaptive 0.198 req/s a device against 0.235 with gap; sarathi 0.207 against 0.235):
            there TTFT limits, and short steps slow every prompt (docs/notes/slo-serving.md)
    device  5x a 32-decode step (Sarathi-Serve's strict SLO): the rule where no SLO is in force
    SECONDS as given

Adaptive's prefill-role instances get their own budget (``--prefill-tbt-slo``, default ``gap``
where the engine's is sized for the SLO: TaiChi's prefill-heavy instances). ``--slo-placement``
and ``--slo-order`` hand the SLO's TTFT limit to placement and to each instance's admission
(scheduling/placement.py, scheduling/hybrid.py); ``--tpot-placement`` its TPOT limit to placement
(prompts kept from where their chunks push running decodes past it). Commands pass the SLO in force (``serve``: its
``--slo``, default balanced; ``replay`` and ``bench goodput``: theirs) to ``engine_and_cluster``.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Optional


def slo_cluster(a: argparse.Namespace, slo, context: Optional[int], engine, cluster):
    """``cluster`` with what the SLO in force sets for adaptive mode: the prefill role's budget
    SLO, and the TTFT limit placement and admission read where asked."""
    if cluster.mode != "adaptive":
        return cluster
    prefill = prefill_tbt(a, slo, context, engine)
    if prefill is not None:
        cluster = replace(cluster, prefill_tbt_slo=prefill)
    placement = getattr(a, "slo_placement", None)
    if placement is None:  # the default: on wherever the SLO in force has a TTFT limit
        placement = slo is not None and any(k == "ttft" for k, _ in slo.terms)
    flags = {"slo_placement": placement, "slo_order": getattr(a, "slo_order", False)}
    if any(flags.values()):
        cluster = replace(cluster, ttft_slo=ttft_terms(slo, flags), placement_slack=a.slo_slack, **flags)
    tpot = getattr(a, "tpot_placement", None)
    if tpot is None:  # the default: on wherever the SLO in force has a TPOT limit
        tpot = slo is not None and any(k == "tpot" for k, _ in slo.terms)
    if tpot:
        cluster = replace(cluster, tpot_slo=tpot_terms(slo))
    return cluster


def ttft_terms(slo, flags: dict) -> tuple:
    """The SLO's TTFT limit as placement reads it: (seconds, a x prefill, b x step)."""
    terms = dict(slo.terms) if slo is not None else {}
    if "ttft" not in terms:
        flag = " and ".join("--" + k.replace("_", "-") for k, v in flags.items() if v)
        raise ValueError(f"{flag} read each prompt's TTFT limit: give an SLO with one (--slo balanced, "
                         "or --slo ttft=1)")
    t = terms["ttft"]
    return (t.seconds, 0.0, 0.0) if not t.relative else (0.0, t.scale, t.floor)


def tpot_terms(slo) -> tuple:
    """The SLO's TPOT limit as placement reads it: (seconds, c x a batch-1 decode step)."""
    terms = dict(slo.terms) if slo is not None else {}
    if "tpot" not in terms:
        raise ValueError("--tpot-placement reads each decode's TPOT limit: give an SLO with one "
                         "(--slo balanced, or --slo tpot=100ms)")
    t = terms["tpot"]
    return (t.seconds, 0.0) if not t.relative else (0.0, t.scale + t.floor)


def tbt_slo_arg(text: str):
    """``--tbt-slo``: seconds, ``gap``, ``tpot`` or ``device``."""
    return _seconds_or(text, ("gap", "tpot", "device"))


def step_limit_arg(text: str):
    """``--step-limit``: seconds, ``gap`` or ``tpot``."""
    return _seconds_or(text, ("gap", "tpot"))


def prefill_tbt_arg(text: str):
    """``--prefill-tbt-slo``: seconds, ``gap``, ``tpot`` or ``same``."""
    return _seconds_or(text, ("gap", "tpot", "same"))


def _seconds_or(text: str, words: tuple):
    """A word of ``words``, or seconds (a value <= 0 is refused by the config, naming the flag)."""
    if text in words:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or one of {', '.join(words)}, got {text!r}") from None


def chunked(a: argparse.Namespace) -> bool:
    """A system whose steps hold a token budget of prompt chunks beside decodes (one the SLO sizes)."""
    mode = getattr(a, "mode", "offline")
    return mode == "adaptive" or (mode in ("coupled", "offline") and a.batching in ("sarathi", "alise"))


def budget_context(a: argparse.Namespace, context: Optional[int]) -> int:
    """The context the token budget holds its step time at: the workload's longest, else the model's."""
    from aserve.config import EngineConfig
    from aserve.devices.measured import model_context

    return context or model_context(EngineConfig(model=a.model, dtype=a.dtype, device=a.device,
                                                 attention=a.attention, cache_dir=a.cache_dir))


def engine_tbt(a: argparse.Namespace, slo, context: Optional[int]) -> Optional[float]:
    """``--tbt-slo`` in seconds (None: the device's rule), its ``gap`` or ``tpot`` rule applied to
    the SLO in force (the flag's help)."""
    choice = a.tbt_slo
    if choice is None:
        sized = slo is not None and chunked(a) and _sizes(slo)
        choice = "gap" if sized else "device"
    return None if choice == "device" else _step_limit(choice, a, slo, context, "--tbt-slo")


def step_limits(a: argparse.Namespace, slo, context: Optional[int]) -> tuple:
    """``--step-limit`` in seconds, the time sized steps fill (``--step-budget sized``), and the
    limit of a step with no decodes (None: the first). By default the SLO's ``tpot`` rule where an
    SLO with a TPOT or token-gap limit is in force (every step a decode runs in within the mean a
    token may take, so a decode's TPOT holds whatever its steps hold; a step with no decodes within
    the token gap: no decode's mean is at stake there, and a lone prompt cut to TPOT-sized chunks
    reached its first token later, 256 tokens at one stream 116 against 93 ms), else (None, None):
    the token budget's own step time. ``gap`` (each step within the token gap) was the default
    until the peer table at 32 streams of 1,024-token prompts read an ITL median of 270 ms against
    115 with ``tpot``, at the same tokens/s (docs/notes/peer.md, eighth session)."""
    choice = getattr(a, "step_limit", None)
    if choice is None:
        choice = "tpot" if slo is not None and _sizes(slo) else None
    if choice is None:
        return None, None
    alone = _step_limit("gap", a, slo, context, "--step-limit") if choice == "tpot" else None
    return _step_limit(choice, a, slo, context, "--step-limit"), alone


def prefill_tbt(a: argparse.Namespace, slo, context: Optional[int], engine) -> Optional[float]:
    """``--prefill-tbt-slo`` in seconds (None: the engine's budget for every role): by default the
    SLO's token gap where the engine's budget is sized for the SLO by default."""
    choice = getattr(a, "prefill_tbt_slo", None)
    if choice is None:
        choice = "gap" if engine.tbt_slo is not None and a.tbt_slo is None and slo is not None else "same"
    if choice == "same" or getattr(a, "mode", None) != "adaptive":
        return None
    return _step_limit(choice, a, slo, context, "--prefill-tbt-slo")


def _step_limit(choice, a: argparse.Namespace, slo, context: Optional[int], flag: str) -> float:
    if not isinstance(choice, str):
        return choice  # seconds, as given
    if slo is None or not _sizes(slo):
        raise ValueError(f"{flag} {choice} sizes a token budget for the SLO in force: give one with a TPOT or "
                         f"token-gap limit (--slo balanced, or --slo tpot=100ms), or {flag} SECONDS")
    ctx = budget_context(a, context)
    if choice == "tpot":
        return slo.step_limit_s(ctx)
    return slo.step_limit_s(ctx, ("token_gap",)) or slo.step_limit_s(ctx)


def _sizes(slo) -> bool:
    return any(k in ("tpot", "token_gap") for k, _ in slo.terms)
