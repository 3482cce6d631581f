"""Frozen configs, built once in ``cli.py`` and passed down."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from model.attention import BACKENDS
from scheduling.coupled import POLICIES


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
    batching: str = "sarathi"
    num_threads: int = 0  # torch threads on CPU; 0 = every core
    cache_dir: Optional[str] = None
    seed: int = 0

    def __post_init__(self):
        if self.attention not in BACKENDS:
            raise ValueError(f"bad attention backend {self.attention!r}: choose one of {', '.join(BACKENDS)}")
        if self.batching not in POLICIES:
            raise ValueError(f"bad batching policy {self.batching!r}: choose one of {', '.join(POLICIES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"bad device {self.device!r}: cpu or cuda[:i]")
