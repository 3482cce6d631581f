"""The paged KV pool: one tensor per instance.

    pool: [L, 2, num_blocks, block_size, H_kv, D]
           |  |      |           |
           |  K/V    block id    slot within the block
           layer

A request's token at position p lives in block ``block_ids[p // block_size]``, slot
``p % block_size``; flat slot = block * block_size + slot. Which blocks a request owns is decided
by ``scheduling.block_manager.BlockManager`` (integers only); this class only holds memory.

Host swap space (ALISE §3) is a second pool of the same shape (``swap_dtype="same"``) or an
``Int8KVCache`` (``"int8"``, ALISE Eq. 8): each block stored as INT8 with one scale per
(layer, K/V, head, channel), taken over the block's tokens::

    q:     [L, 2, num_blocks, block_size, H_kv, D]  int8     x ≈ q · scale
    scale: [L, 2, num_blocks, 1,          H_kv, D]  fp32

Both expose ``blocks_to`` / ``blocks_from``, so the runner swaps without knowing the format.
"""
from __future__ import annotations

from typing import Union

import torch

from model.config import ModelArgs


def kv_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return args.num_layers * 2 * block_size * args.num_kv_heads * args.head_dim * elem


def num_blocks_for_budget(args: ModelArgs, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    n = budget_bytes // kv_bytes_per_block(args, block_size, dtype)
    if n < 1:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens")
    return int(n)


class KVCache:
    """Owns the pool tensor for one instance's device."""

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 scratch: bool = False):
        """``scratch``: one block more than ``num_blocks``, at index ``num_blocks``, that no block
        manager hands out: the pad rows of a replayed CUDA graph write their K/V there and attend to
        it alone (aserve/devices/cuda_graphs.py), so they never touch a request's blocks."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks if scratch else None
        shape = (args.num_layers, 2, num_blocks + int(scratch), block_size, args.num_kv_heads, args.head_dim)
        self.pool = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def block_bytes(self) -> int:
        return self.pool[:, :, 0].numel() * self.pool.element_size()

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def blocks_to(self, block_ids: list[int], device="cpu") -> torch.Tensor:
        """Copy some blocks out (swap to host): [L, 2, n, block_size, H_kv, D]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        return self.pool.index_select(2, idx).to(device)

    def blocks_from(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Copy blocks in (swap from host) into ``block_ids``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        self.pool.index_copy_(2, idx, data.to(self.pool.device, self.pool.dtype))


SWAP_DTYPES = ("same", "int8")  # how host swap space stores a block: the pool's dtype, or INT8 + scales
TOKEN_DIM = 3  # the block_size axis of [L, 2, n, block_size, H_kv, D]: scales reduce over it
INT8_MAX = 127


# Scales stay fp32 even for 16-bit models: then each channel's largest value comes back exactly
# (127 · scale = max|x|); bf16 scales would save 2 of 20 bytes a channel but doubled the mean
# logit error on the default model in bf16 (0.15 against 0.07, one decode step, 6 prompts).
SCALE_DTYPE = torch.float32


def quantize_int8(x: torch.Tensor, dim: int = TOKEN_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 with one fp32 scale per slice along ``dim`` (kept as size 1 for
    broadcasting): ``scale = max|x| / 127``, ``q = round(x / scale)``, so |x - q·scale| <=
    scale / 2 elementwise; an all-zero channel gets scale 0 and q 0 (no division by zero)."""
    scale = x.abs().amax(dim=dim, keepdim=True).to(SCALE_DTYPE) / INT8_MAX
    q = (x.to(SCALE_DTYPE) / torch.where(scale > 0, scale, torch.ones_like(scale))).round_()
    return q.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q · scale`` in ``dtype`` (computed in fp32, rounded once to ``dtype``)."""
    return (q.float() * scale.float()).to(dtype)


class Int8KVCache:
    """Host swap space holding blocks as INT8 with channel-wise scales (module picture).

    ``blocks_from`` quantises on the device the data comes from and ``blocks_to`` dequantises on
    the device it goes to, so only INT8 bytes and scales cross between device and host memory.
    """

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu"):
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        shape = (args.num_layers, 2, num_blocks, block_size, args.num_kv_heads, args.head_dim)
        self.q = torch.zeros(shape, dtype=torch.int8, device=device)
        self.scale = torch.zeros(shape[:3] + (1,) + shape[4:], dtype=SCALE_DTYPE, device=device)

    @property
    def block_bytes(self) -> int:
        return self.q[:, :, 0].numel() + self.scale[:, :, 0].numel() * self.scale.element_size()

    @property
    def device(self) -> torch.device:
        return self.q.device

    def blocks_to(self, block_ids: list[int], device="cpu") -> torch.Tensor:
        """Dequantised blocks in the model dtype: [L, 2, n, block_size, H_kv, D]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.q.device)
        q, scale = self.q.index_select(2, idx).to(device), self.scale.index_select(2, idx).to(device)
        return dequantize_int8(q, scale, self.dtype)

    def blocks_from(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Quantise ``data`` [L, 2, n, block_size, H_kv, D] into ``block_ids``."""
        q, scale = quantize_int8(data, TOKEN_DIM)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.q.device)
        self.q.index_copy_(2, idx, q.to(self.q.device))
        self.scale.index_copy_(2, idx, scale.to(self.q.device))


HostKV = Union[KVCache, Int8KVCache]


def swap_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype, swap_dtype: str) -> int:
    """Host bytes one swapped block takes in ``swap_dtype`` (one of ``SWAP_DTYPES``)."""
    if swap_dtype == "same":
        return kv_bytes_per_block(args, block_size, dtype)
    if swap_dtype != "int8":
        raise ValueError(f"bad swap_dtype {swap_dtype!r}: choose one of {', '.join(SWAP_DTYPES)}")
    channels = args.num_layers * 2 * args.num_kv_heads * args.head_dim
    return channels * (block_size + torch.empty((), dtype=SCALE_DTYPE).element_size())


def num_swap_blocks(args: ModelArgs, block_size: int, dtype: torch.dtype, budget_bytes: int,
                    swap_dtype: str = "same") -> int:
    """How many host blocks ``budget_bytes`` holds in ``swap_dtype`` (a device in another process
    knows the count before its swap space exists)."""
    n = budget_bytes // swap_bytes_per_block(args, block_size, dtype, swap_dtype)
    if n < 1:
        raise ValueError(f"a swap budget of {budget_bytes} bytes holds no {swap_dtype} block of {block_size} tokens")
    return int(n)


def host_swap_space(args: ModelArgs, block_size: int, dtype: torch.dtype, budget_bytes: int,
                    swap_dtype: str = "same") -> HostKV:
    """As many host blocks as ``budget_bytes`` holds in ``swap_dtype`` (at 16 tokens a block
    INT8 with fp32 scales holds 1.6x the blocks of bf16 and 3.2x those of fp32)."""
    n = num_swap_blocks(args, block_size, dtype, budget_bytes, swap_dtype)
    if swap_dtype == "int8":
        return Int8KVCache(args, n, block_size, dtype, "cpu")
    return KVCache(args, n, block_size, dtype, "cpu")
