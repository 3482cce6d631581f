"""The paged KV pool: one tensor per instance.

    pool: [L, 2, num_blocks, block_size, H_kv, D]
           |  |      |           |
           |  K/V    block id    slot within the block
           layer

A request's token at position p lives in block ``block_ids[p // block_size]``, slot
``p % block_size``; flat slot = block * block_size + slot. Which blocks a request owns is decided
by ``scheduling.block_manager.BlockManager`` (integers only); this class only holds memory.
"""
from __future__ import annotations

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

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (args.num_layers, 2, num_blocks, block_size, args.num_kv_heads, args.head_dim)
        self.pool = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def block_bytes(self) -> int:
        return self.pool[:, :, 0].numel() * self.pool.element_size()

    def blocks_to(self, block_ids: list[int], device="cpu") -> torch.Tensor:
        """Copy some blocks out (swap to host): [L, 2, n, block_size, H_kv, D]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        return self.pool.index_select(2, idx).to(device)

    def blocks_from(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Copy blocks in (swap from host) into ``block_ids``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        self.pool.index_copy_(2, idx, data.to(self.pool.device, self.pool.dtype))
