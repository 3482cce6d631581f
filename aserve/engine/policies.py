"""Which scheduler each role runs: the policy names and settings of the configs, built once.

    role prefill  -> registry "prefill"  (fcfs | sjf | ljf) + a "dispatch" policy
    role decode   -> registry "decode"   (greedy | reserve-static | reserve-dynamic)
    role coupled  -> registry "batching" (sarathi | vllm | alise)
    adaptive mode -> scheduling/hybrid.py for prefill and decode roles alike (decodes plus prompt
                     chunks within the token budget); the role only says where finished prompts go

A flip builds the other role's scheduler over the same blocks; nothing else changes (adaptive
mode: the same scheduler stays, with its requests, and only its hand-over switch changes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from aserve.config import ClusterConfig, EngineConfig
from aserve.devices.device import Device
from scheduling import registry
from scheduling.base import Scheduler
from scheduling.block_manager import BlockManager
from scheduling.clock import Clock
from scheduling.coupled import BatchingConfig, StepRoom
from scheduling.decode import DecodeConfig
from scheduling.dispatch import Dispatcher, DispatchConfig
from scheduling.hybrid import HybridConfig
from scheduling.prefill import PrefillConfig

ROLES = ("prefill", "decode", "coupled")


@dataclass(frozen=True)
class Policies:
    prefill: str = "fcfs"
    prefill_config: PrefillConfig = field(default_factory=PrefillConfig)
    dispatch: str = "interference"
    dispatch_config: DispatchConfig = field(default_factory=DispatchConfig)
    decode: str = "greedy"
    decode_config: DecodeConfig = field(default_factory=DecodeConfig)
    batching: str = "sarathi"
    batching_config: BatchingConfig = field(default_factory=BatchingConfig)
    adaptive: bool = False  # prefill and decode roles both run the hybrid scheduler
    token_budget: int = 512  # adaptive: rows of one hybrid step (the engine's max_num_batched_tokens)
    prefill_token_budget: Optional[int] = None  # adaptive: the prefill role's own (None: token_budget)
    prompt_first_rows: Optional[int] = None  # adaptive: a step's fixed time in prompt rows, if prompts go first
    deadline_order: bool = False  # adaptive: admit prompts by TTFT deadline (--slo-order)
    prefix_caching: bool = True  # every instance's block manager keeps and shares full blocks (scheduling/prefix.py)

    @staticmethod
    def from_configs(engine: EngineConfig, cluster: Optional[ClusterConfig] = None,
                     step_room: Optional[StepRoom] = None) -> "Policies":
        """The offline engine needs only ``engine`` (it runs the coupled role). ``step_room``: sized
        Sarathi steps (``aserve.devices.measured.step_room``, which the caller measures)."""
        batching = BatchingConfig(engine.max_num_batched_tokens, engine.max_num_seqs, step_room=step_room)
        if cluster is None:
            return Policies(batching=engine.batching, batching_config=batching,
                            prefix_caching=engine.enable_prefix_caching)
        return Policies(
            prefill=cluster.prefill_policy,
            prefill_config=PrefillConfig(cluster.chunk_size, cluster.prefill_sched_batch, cluster.pad),
            dispatch=cluster.dispatch, dispatch_config=DispatchConfig(cluster.heavy_threshold, cluster.seed),
            decode=cluster.decode_policy,
            decode_config=DecodeConfig(max_running=engine.max_num_seqs, preemption=cluster.preemption,
                                       heavy_threshold=cluster.heavy_threshold),
            batching=engine.batching, batching_config=batching,
            adaptive=cluster.mode == "adaptive", token_budget=engine.max_num_batched_tokens,
            prefill_token_budget=cluster.prefill_token_budget, deadline_order=cluster.slo_order,
            prompt_first_rows=_fixed_rows(cluster) if cluster.prompt_first else None,
            prefix_caching=engine.enable_prefix_caching)

    def scheduler(self, role: str, blocks: BlockManager, device: Device, clock: Clock) -> Scheduler:
        """The role's scheduler over ``blocks``; swap space is added to ``device`` where the
        policy preempts to host memory."""
        if role == "prefill" and not self.adaptive:
            return registry.get("prefill", self.prefill)(blocks, self.prefill_config, clock)
        if role in ("prefill", "decode"):
            config = self.decode_config
            if config.preemption == "swap":
                config = dataclasses.replace(config, num_swap_blocks=device.add_swap_space())
            if self.adaptive:
                hybrid = HybridConfig(self.role_budget(role), hand_over=role == "prefill",
                                      watermark=self.batching_config.watermark,
                                      prompt_first_rows=self.prompt_first_rows,
                                      deadline_order=self.deadline_order)
                return registry.get("adaptive", "hybrid")(blocks, config, hybrid, clock)
            return registry.get("decode", self.decode)(blocks, config, clock)
        if role == "coupled":
            cls = registry.get("batching", self.batching)
            if cls.uses_swap:
                host = BlockManager(device.add_swap_space(), blocks.block_size)
                return cls(blocks, self.batching_config, clock, host_blocks=host)
            return cls(blocks, self.batching_config, clock)
        raise ValueError(f"bad role {role!r}: choose one of {', '.join(ROLES)}")

    def role_budget(self, role: str) -> int:
        """Adaptive: the token budget of a ``role`` instance (TaiChi's sliders: prefill-heavy
        instances may run longer steps than decode-heavy ones)."""
        return self.prefill_token_budget or self.token_budget if role == "prefill" else self.token_budget

    def dispatcher(self) -> Dispatcher:
        return registry.get("dispatch", self.dispatch)(self.dispatch_config)


def _fixed_rows(cluster: ClusterConfig) -> int:
    """A step's fixed time in prompt rows, from the placement's measured step costs."""
    return round(cluster.placement_step_s / max(cluster.placement_prefill_token_s, 1e-9))
