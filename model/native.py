"""Our C++ CPU kernels, compiled on first use with torch's extension builder (about a minute,
cached under ~/.cache/torch_extensions), and skipped with a clear reason where no compiler is."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

_SRC = Path(__file__).parent / "csrc" / "paged_attention.cpp"


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module, or raise RuntimeError saying why it cannot be built."""
    from torch.utils.cpp_extension import load as build

    try:
        return build(name="aserve_native_v2", sources=[str(_SRC)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                     extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # compiler missing, headers missing, ...
        raise RuntimeError(f"cannot build aserve's C++ kernels: {e}") from e


@functools.lru_cache(maxsize=1)
def available() -> bool:
    try:
        load()
    except RuntimeError:
        return False
    return True


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D]; caches [num_blocks, block_size, H_kv, D]; returns [B, H, D]."""
    return load().paged_decode(q.contiguous(), k_cache, v_cache, tables, ctx_lens, scale)
