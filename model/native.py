"""Our C++ CPU kernels, compiled on first use with torch's extension builder (about a minute,
cached under ~/.cache/torch_extensions), and skipped with a clear reason where no compiler is.

- ``paged_decode``: decode attention that reads K/V blocks in place (``model/csrc/paged_attention.cpp``);
- ``linear``: a bf16 linear for decode-sized batches on CPUs with AVX512-BF16, which streams the
  weights once (``model/csrc/linear_bf16.cpp``); larger batches stay on torch's matmul;
- ``llama_decode``: a whole decode-only step of a bf16 LLaMA model in one call
  (``model/csrc/llama_decode.cpp``), so the ~25 small ops per layer are not dispatched one by one.

Each call lets the GIL go while it runs: a cluster's instances, its length predictor and its event
loop are threads of one process, and must not wait for one another's kernels.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [str(_CSRC / name) for name in ("paged_attention.cpp", "linear_bf16.cpp", "llama_decode.cpp")]
# rows up to which our bf16 linear beats torch's matmul on the machines measured (see
# docs/BENCHMARKS.md, "Engine"); above it the matmul's blocking wins
LINEAR_MAX_ROWS = 8
# ASERVE_NATIVE_LINEAR=0 keeps every linear on torch's matmul (for A/B measurements)
NATIVE_LINEAR = os.environ.get("ASERVE_NATIVE_LINEAR", "1") != "0"
# ASERVE_NATIVE_STEP=0 runs decode steps op by op in Python even where llama_decode could
NATIVE_STEP = os.environ.get("ASERVE_NATIVE_STEP", "1") != "0"


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module, or raise RuntimeError saying why it cannot be built."""
    from torch.utils.cpp_extension import load as build

    try:
        return build(name="aserve_native_v7", sources=_SOURCES, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                     extra_include_paths=[str(_CSRC)], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # compiler missing, headers missing, ...
        raise RuntimeError(f"cannot build aserve's C++ kernels: {e}") from e


@functools.lru_cache(maxsize=1)
def available() -> bool:
    try:
        load()
    except RuntimeError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def bf16_linear_available() -> bool:
    """True where the kernels build and the CPU has AVX512-BF16 dot products."""
    return available() and load().has_bf16_linear()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D]; caches [num_blocks, block_size, H_kv, D]; returns [B, H, D]."""
    return load().paged_decode(q.contiguous(), k_cache, v_cache, tables, ctx_lens, scale)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` with our bf16 kernel where it is faster: bf16 CPU tensors, at most
    ``LINEAR_MAX_ROWS`` rows, an input width that is a multiple of 32. Called by every linear
    layer of every step: the cheapest tests come first."""
    if (NATIVE_LINEAR and x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and x.device.type == "cpu"
            and x.dim() == 2 and x.shape[0] <= LINEAR_MAX_ROWS and x.shape[1] % 32 == 0
            and not torch.is_grad_enabled() and bf16_linear_available()):
        return load().linear_bf16(x, weight, bias)
    return F.linear(x, weight, bias)


def llama_decode(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: list, final_norm: torch.Tensor,
                 kv: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor,
                 num_heads: int, eps: float, scale: float) -> torch.Tensor:
    """A decode-only step through every layer: x [T, E] bf16 embeddings -> final-normed hidden
    [T, E]; ``weights`` holds six tensors per layer (``model/csrc/llama_decode.cpp``)."""
    native_rows = LINEAR_MAX_ROWS if NATIVE_LINEAR else 0  # the same choice ``linear`` makes
    return load().llama_decode(x, cos, sin, weights, final_norm, kv, slots, tables, ctx_lens, num_heads, eps, scale,
                               native_rows)
