"""Our C++ CPU kernels, compiled on first use with torch's extension builder (about a minute,
cached under ~/.cache/torch_extensions), and skipped with a clear reason where no compiler is.

- ``paged_decode``: decode attention that reads K/V blocks in place (``model/csrc/paged_attention.cpp``,
  with a bf16 fast path in ``paged_decode_bf16.cpp``);
- ``linear`` and ``silu_mul``: bf16 matrix products on CPUs with AVX512-BF16 over weights packed
  once, on first use, into the layout of ``model/csrc/gemm_bf16.cpp`` (faster than torch's
  matmul at every batch size measured, 1 to 512 rows, so every bf16 CPU linear goes there);
- ``llama_decode``: a whole decode-only step of a bf16 LLaMA model in one call
  (``model/csrc/llama_decode.cpp``), so the ~25 small ops per layer are not dispatched one by one.

The packed copy of a weight lives on the weight tensor itself (an attribute) and is remade when
the weight changes in place or moves: a bf16 model on the CPU holds its weights twice (the
default model: 270 MB more), the torch layout for everything else that reads them.

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
_SOURCES = [str(_CSRC / name) for name in
            ("paged_attention.cpp", "paged_decode_bf16.cpp", "gemm_bf16.cpp", "llama_decode.cpp")]
# ASERVE_NATIVE_LINEAR=0 keeps every linear on torch's matmul (for A/B measurements)
NATIVE_LINEAR = os.environ.get("ASERVE_NATIVE_LINEAR", "1") != "0"
# ASERVE_NATIVE_STEP=0 runs decode steps op by op in Python even where llama_decode could
NATIVE_STEP = os.environ.get("ASERVE_NATIVE_STEP", "1") != "0"


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module, or raise RuntimeError saying why it cannot be built."""
    from torch.utils.cpp_extension import load as build

    try:
        return build(name="aserve_native_v8", sources=_SOURCES, extra_cflags=["-O3", "-march=native", "-fopenmp"],
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


def packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of ``x`` and ``weight`` goes to our packed kernel: bf16 CPU tensors, an
    even input width, no autograd. Called on every linear of every step: cheapest tests first."""
    return (NATIVE_LINEAR and x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and x.device.type == "cpu"
            and weight.shape[1] % 2 == 0 and not torch.is_grad_enabled() and bf16_linear_available())


def packed(weight: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """The packed copy of a bf16 ``weight`` [N, K] (``gate_up``: a fused [gate; up] weight in the
    order ``silu_mul`` reads), made on first use and remade if the weight changed since."""
    key = "_aserve_packed_gate_up" if gate_up else "_aserve_packed"
    cached = getattr(weight, key, None)  # (version, data pointer, packed tensor)
    if cached is not None and cached[0] == weight._version and cached[1] == weight.data_ptr():
        return cached[2]
    mod = load()
    p = mod.pack_bf16(weight.detach(), mod.ORDER_GATE_UP if gate_up else mod.ORDER_PLAIN)
    setattr(weight, key, (weight._version, weight.data_ptr(), p))
    return p


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear``, through our packed bf16 kernel where it applies (see ``_packable``)."""
    if packable(x, weight):
        y = load().linear_packed(x.reshape(-1, x.shape[-1]), packed(weight), weight.shape[0], bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(x @ gate.T) * (x @ up.T)`` for a fused ``gate_up`` weight [2 I, K]: one
    packed product with the activation in its epilogue where it applies (I a multiple of 32),
    else the three torch ops. Rounded to bf16 where torch's ops round, so both agree."""
    if packable(x, gate_up) and gate_up.shape[0] % 64 == 0:
        y = load().silu_mul_packed(x.reshape(-1, x.shape[-1]), packed(gate_up, gate_up=True))
        return y.view(*x.shape[:-1], gate_up.shape[0] // 2)
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.silu(gate) * up


def llama_decode(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: list, final_norm: torch.Tensor,
                 kv: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor,
                 num_heads: int, eps: float, scale: float) -> torch.Tensor:
    """A decode-only step through every layer: x [T, E] bf16 embeddings -> final-normed hidden
    [T, E]; ``weights`` holds six tensors per layer (attn_norm, qkv, o, mlp_norm, gate_up, down:
    the Parameters; the four matrices are handed over packed)."""
    step = []
    for i in range(0, len(weights), 6):
        attn_norm, qkv, o, mlp_norm, gate_up, down = weights[i:i + 6]
        step += [attn_norm, packed(qkv), packed(o), mlp_norm, packed(gate_up, gate_up=True), packed(down)]
    return load().llama_decode(x, cos, sin, step, final_norm, kv, slots, tables, ctx_lens, num_heads, eps, scale)
