"""Block manager: a free list of KV-cache block ids with reference counts.

Integers only. The pool tensor itself lives in ``model/kv_cache.py``; this class decides which
of its ``num_blocks`` blocks a request owns. Block ``i`` holds token slots
``[i * block_size, (i + 1) * block_size)`` of the pool viewed flat.
"""
from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns block ids ``0 .. num_blocks-1``; ``allocate`` and ``free`` keep ref counts.

    Invariant: a block is in the free list exactly when its ref count is zero.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (ref count 1 each)."""
        if num_blocks > len(self._free):
            raise OutOfBlocks(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for b in block_ids:
            self._ref[b] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Add a reference to blocks already held (prefix sharing, forks)."""
        for b in block_ids:
            assert self._ref[b] > 0, f"block {b} is free"
            self._ref[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the free list."""
        for b in block_ids:
            assert self._ref[b] > 0, f"double free of block {b}"
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def grow(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """Extend ``block_ids`` in place so it holds ``num_tokens`` tokens; returns the new ids."""
        missing = blocks_needed(num_tokens, self.block_size) - len(block_ids)
        if missing <= 0:
            return []
        new_ids = self.allocate(missing)
        block_ids.extend(new_ids)
        return new_ids
