"""Block manager: a free list of KV-cache block ids with reference counts.

Integers only, and keys. The pool tensor itself lives in ``model/kv_cache.py``; this class
decides which of its ``num_blocks`` blocks a request owns. Block ``i`` holds token slots
``[i * block_size, (i + 1) * block_size)`` of the pool viewed flat.

A block whose contents others may reuse (a full prompt block the n choices of one request share,
scheduling/prefix.py) is published under a key; ``lookup`` finds it while some request still
holds it. A key lives exactly as long as its block's references: the block's last ``free`` drops
it, so a freed block never answers a lookup and nothing is cached past its holders.
"""
from __future__ import annotations

from collections import deque
from typing import Hashable, Sequence


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
        self._by_key: dict[Hashable, int] = {}  # published block contents -> the block holding them
        self._key_of: dict[int, Hashable] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """Requests holding the block (0: free)."""
        return self._ref[block_id]

    def num_freed_by(self, block_lists: Sequence[Sequence[int]]) -> int:
        """Blocks that would return to the free list if each list dropped its reference: a block
        shared with a holder not among them stays."""
        drops: dict[int, int] = {}
        for ids in block_lists:
            for b in ids:
                drops[b] = drops.get(b, 0) + 1
        return sum(n == self._ref[b] for b, n in drops.items())

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
                key = self._key_of.pop(b, None)
                if key is not None:
                    del self._by_key[key]

    def grow(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """Extend ``block_ids`` in place so it holds ``num_tokens`` tokens; returns the new ids."""
        missing = blocks_needed(num_tokens, self.block_size) - len(block_ids)
        if missing <= 0:
            return []
        new_ids = self.allocate(missing)
        block_ids.extend(new_ids)
        return new_ids

    def publish(self, keys: Sequence[Hashable], block_ids: Sequence[int]) -> None:
        """Make held blocks findable by key (block ``block_ids[i]`` holds what ``keys[i]`` names).
        A key already published, or a block already under a key, stays as it is."""
        for key, b in zip(keys, block_ids):
            assert self._ref[b] > 0, f"block {b} is free"
            if key not in self._by_key and b not in self._key_of:
                self._by_key[key] = b
                self._key_of[b] = key

    def lookup(self, keys: Sequence[Hashable]) -> list[int]:
        """The blocks published under ``keys[0], keys[1], ...``, up to the first key not found
        (a prefix is only of use whole). No reference is taken: ``share`` them to keep them."""
        found = []
        for key in keys:
            b = self._by_key.get(key)
            if b is None:
                break
            found.append(b)
        return found

    @property
    def num_published(self) -> int:
        return len(self._by_key)
