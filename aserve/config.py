"""Frozen configs, built once in ``cli.py`` and passed down."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from model.attention import BACKENDS
from scheduling.alise import ALL_POLICIES


@dataclass(frozen=True)
class EngineConfig:
    """What one instance's engine needs: the model, its dtype and device, the KV pool, batching."""

    model: str = "default"
    dtype: str = "auto"  # auto | bf16 | fp16 | fp32
    device: str = "cpu"
    attention: str = "sdpa"
    block_size: int = 16
    kv_cache_gb: float = 1.0
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    batching: str = "sarathi"  # coupled policy: sarathi | vllm | alise
    swap_gb: float = 0.25  # host swap space for preempted KV (alise, decode swap)
    num_threads: int = 0  # torch threads on CPU; 0 = every core
    cache_dir: Optional[str] = None
    seed: int = 0

    def __post_init__(self):
        if self.attention not in BACKENDS:
            raise ValueError(f"bad attention backend {self.attention!r}: choose one of {', '.join(BACKENDS)}")
        if self.batching not in ALL_POLICIES:
            raise ValueError(f"bad batching policy {self.batching!r}: choose one of {', '.join(ALL_POLICIES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.swap_gb < 0:
            raise ValueError(f"swap_gb must be >= 0, got {self.swap_gb}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"bad device {self.device!r}: cpu or cuda[:i]")


MODES = ("disagg", "coupled")


@dataclass(frozen=True)
class ClusterConfig:
    """The instances and the policies between them (TetriInfer's knobs and the baselines')."""

    mode: str = "disagg"
    num_prefill: int = 1
    num_decode: int = 1
    num_coupled: int = 2
    # prefill instances
    prefill_policy: str = "fcfs"  # fcfs | sjf | ljf
    prefill_sched_batch: int = 16
    chunk_size: int = 512
    pad: bool = True
    # dispatch and decode instances
    dispatch: str = "interference"
    decode_policy: str = "greedy"  # greedy | reserve-static | reserve-dynamic
    preemption: str = "recompute"  # recompute | swap (swap space: EngineConfig.swap_gb)
    heavy_threshold: int = 128
    predictor: str = "oracle"  # oracle | none (more with the predictors)
    # interconnect
    link: str = "nvlink"
    emulate_model: Optional[str] = None
    emulate_kv_bytes_per_token: Optional[int] = None
    # control plane
    monitor_interval_s: float = 0.1
    seed: int = 0

    def __post_init__(self):
        from scheduling.registry import DECODE_POLICIES, DISPATCH_POLICIES, PREFILL_POLICIES

        if self.mode not in MODES:
            raise ValueError(f"bad mode {self.mode!r}: choose one of {', '.join(MODES)}")
        counts = (self.num_prefill, self.num_decode) if self.mode == "disagg" else (self.num_coupled,)
        if min(counts) < 1:
            raise ValueError(f"{self.mode} mode needs at least one instance of each kind, got {counts}")
        for value, table, field in ((self.prefill_policy, PREFILL_POLICIES, "prefill_policy"),
                                    (self.dispatch, DISPATCH_POLICIES, "dispatch"),
                                    (self.decode_policy, DECODE_POLICIES, "decode_policy")):
            if value not in table:
                raise ValueError(f"bad {field} {value!r}: choose one of {', '.join(table)}")
        if self.preemption not in ("recompute", "swap"):
            raise ValueError(f"bad preemption {self.preemption!r}: recompute or swap")
        if self.chunk_size < 1 or self.prefill_sched_batch < 1:
            raise ValueError("chunk_size and prefill_sched_batch must be >= 1")
        if self.predictor not in ("oracle", "none"):
            raise ValueError(f"bad predictor {self.predictor!r}: choose one of oracle, none")
        if self.monitor_interval_s <= 0:
            raise ValueError("monitor_interval_s must be > 0")

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode if self.mode == "disagg" else self.num_coupled
