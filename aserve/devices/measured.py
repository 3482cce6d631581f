"""Measured defaults, resolved in one start-up step.

Three settings default to what the device measures rather than to a fixed number; a config leaves
them ``None`` ("measure") and ``resolve`` fills them in, once, before anything starts:

- ``ClusterConfig.chunk_size``: the profile's saturate chunk (TetriInfer's ChunkSize), at the
  instances' threads;
- ``EngineConfig.max_num_batched_tokens``: with vllm batching the model's context window; else the
  budget ``aserve profile token-budget`` saved (unless ``tbt_slo`` is given), else Sarathi-Serve's rule on the measured costs: the
  most tokens a step may hold while a step of ``BUDGET_DECODE_BATCH`` decodes at
  ``EngineConfig.budget_context`` (default the model's context window) stays within
  ``EngineConfig.tbt_slo`` (default 5x that decode-only step);
- ``ClusterConfig.prefill_token_budget`` (adaptive, where ``prefill_tbt_slo`` is set): the same
  rule at that SLO, for the prefill-role instances (never below the engine's budget);
- ``ClusterConfig.placement_*_s`` (adaptive placement's step costs): a step's fixed time, a prompt
  token's and a decode row's (32 rows at 512 tokens of context); other modes keep the fixed defaults,
  which they never read.

The cost model is this machine's measured engine (``aserve profile device``, measured on first need
and cached) or a ``sim:`` profile, at the threads each instance gets (every core, or
``num_threads``, shared evenly over the instances). ``Cluster`` calls ``resolve`` itself; a command
that prints the settings before it starts one calls it first (resolving twice changes nothing).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from aserve.config import ClusterConfig, EngineConfig

BUDGET_DECODE_BATCH = 32  # running decodes the Sarathi token budget is sized for
PLACEMENT_FIELDS = ("placement_step_s", "placement_prefill_token_s", "placement_decode_row_s")
_FIXED = ClusterConfig()  # the fixed defaults of the placement costs, for modes that never read them


def threads_each(num_threads: int, num_instances: int) -> int:
    """Torch threads each of ``num_instances`` gets: the cores (``num_threads``, else every core)
    shared evenly."""
    return max(1, (num_threads or os.cpu_count() or 1) // max(1, num_instances))


def instance_threads(engine: EngineConfig, cluster: Optional[ClusterConfig]) -> int:
    """Torch threads each instance of ``cluster`` (None: the offline engine alone) gets."""
    num = 1 if cluster is None else (cluster.num_prefill + cluster.num_decode if cluster.split else cluster.num_coupled)
    return threads_each(engine.num_threads, num)


def model_engine(engine: EngineConfig) -> EngineConfig:
    """The engine fields that decide the model (and what a profile measures), nothing derived."""
    return EngineConfig(model=engine.model, dtype=engine.dtype, device=engine.device, attention=engine.attention,
                        kernels=engine.kernels, block_size=engine.block_size, cache_dir=engine.cache_dir,
                        allow_profile_mismatch=engine.allow_profile_mismatch)


def measured_cost(engine: EngineConfig, threads: int):
    """The device's cost model at ``threads``: this machine's measured engine (measured now if
    never before), or a simulated device's profile."""
    from aserve.devices.factory import device_cost

    return device_cost(model_engine(engine), threads)


def model_context(engine: EngineConfig) -> int:
    """The (served or simulated) model's context window, from its config (no weights loaded)."""
    from aserve.devices.factory import model_args

    return model_args(model_engine(engine)).max_position


def needs_measuring(engine: EngineConfig, cluster: Optional[ClusterConfig] = None) -> bool:
    return engine.max_num_batched_tokens is None or (cluster is not None and (
        cluster.chunk_size is None or any(getattr(cluster, f) is None for f in PLACEMENT_FIELDS)
        or _prefill_budget_unset(cluster)))


def _prefill_budget_unset(cluster: ClusterConfig) -> bool:
    return cluster.mode == "adaptive" and cluster.prefill_tbt_slo is not None and cluster.prefill_token_budget is None


def resolve(engine: EngineConfig, cluster: Optional[ClusterConfig] = None
            ) -> tuple[EngineConfig, Optional[ClusterConfig]]:
    """``engine`` and ``cluster`` with every setting left to be measured filled in (the module doc)."""
    if not needs_measuring(engine, cluster):
        return engine, cluster
    threads = instance_threads(engine, cluster)
    costs = []  # measured (or loaded) once, on first need

    def cost():
        if not costs:
            costs.append(measured_cost(engine, threads))
        return costs[0]

    if engine.max_num_batched_tokens is None:
        engine = dataclasses.replace(engine, max_num_batched_tokens=_token_budget(engine, threads, cost))
    if cluster is not None:
        changes = {}
        if cluster.chunk_size is None:
            changes["chunk_size"] = cost().saturate_chunk()
        if any(getattr(cluster, f) is None for f in PLACEMENT_FIELDS):
            measured = _placement_costs(cost()) if cluster.mode == "adaptive" else {
                f: getattr(_FIXED, f) for f in PLACEMENT_FIELDS}
            changes.update({f: v for f, v in measured.items() if getattr(cluster, f) is None})
        if _prefill_budget_unset(cluster):
            changes["prefill_token_budget"] = max(engine.max_num_batched_tokens, _sized_budget(
                engine, cost(), cluster.prefill_tbt_slo))
        cluster = dataclasses.replace(cluster, **changes)
    return engine, cluster


def _token_budget(engine: EngineConfig, threads: int, cost) -> int:
    if engine.batching == "vllm":
        return model_context(engine)
    from aserve.profiles.profile_store import token_budget

    # a saved budget was measured for its own SLO: one given now (--tbt-slo, or the SLO in force) sizes its own
    saved = None if engine.tbt_slo else token_budget(engine.cache_dir, engine.model, engine.device, engine.dtype, threads)
    if saved:
        return saved
    c = cost()
    return _sized_budget(engine, c, _budget_step_s(engine, c))


def _budget_step_s(engine: EngineConfig, c) -> float:
    """The step time the token budget is sized for: ``tbt_slo``, else 5x a 32-decode step at the
    budget context (the model's context window unless given)."""
    return engine.tbt_slo or c.decode_slo_s(BUDGET_DECODE_BATCH, engine.budget_context or model_context(engine))


def _sized_budget(engine: EngineConfig, c, slo_s: float, context: Optional[int] = None) -> int:
    """Sarathi-Serve's rule: the largest budget whose step beside ``BUDGET_DECODE_BATCH`` decodes
    at the budget context (``context`` when the caller has it) stays within ``slo_s``."""
    return c.token_budget(slo_s, BUDGET_DECODE_BATCH, context or engine.budget_context or model_context(engine))


def step_room(engine: EngineConfig, cluster: Optional[ClusterConfig] = None):
    """Sarathi batching with ``step_budget`` sized: the ``StepRoom`` of each instance's steps, at
    ``step_limit_s`` (else the step time the budget is sized for: ``tbt_slo``, else 5x a 32-decode
    step at the budget context; a step with no decodes at ``step_limit_alone_s`` where given) on the
    device's cost model at the instances' threads; else None (the budget alone)."""
    if engine.step_budget != "sized" or engine.batching != "sarathi":
        return None
    from scheduling.coupled import StepRoom

    c = measured_cost(engine, instance_threads(engine, cluster))
    return StepRoom(engine.step_limit_s or _budget_step_s(engine, c), c.room_step_s, alone_s=engine.step_limit_alone_s)


def _placement_costs(cost) -> dict:
    fixed = cost.linear(1)
    return {"placement_step_s": fixed, "placement_prefill_token_s": max(0.0, cost.prefill_s(256) - fixed) / 256,
            "placement_decode_row_s": max(0.0, cost.decode_s(32, 512) - cost.decode_s(1, 512)) / 31}
