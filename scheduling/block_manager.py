"""Block manager: KV-cache block ids with reference counts, and the prefix cache over them.

Integers only, and keys. The pool tensor itself lives in ``model/kv_cache.py``; this class
decides which of its ``num_blocks`` blocks a request owns. Block ``i`` holds token slots
``[i * block_size, (i + 1) * block_size)`` of the pool viewed flat.

A block whose contents others may reuse (a full block, named by a hash chained over every token
up to its end: scheduling/prefix.py) is published under a key; ``lookup`` finds it and ``share``
takes a reference to it. What happens when its last holder frees it depends on the cache::

    enable_caching=False:  ref 1 ──free──► free list          (the key goes: nothing outlives its holders)
    enable_caching=True:   ref 1 ──free──► cached (ref 0, key kept, least recently freed first)
                                              │ share (a lookup hit): ref 1 again, out of the LRU
                                              └ allocate finds no uncached free block: evicted,
                                                its key dropped, handed out as a new block

A cached block counts as free (``num_free``): every admission test sees the same room with the
cache as without it, and a block is evicted before anything is refused or preempted, so a cache
that fills never loses a request room. Invariant: ``num_free + held == num_blocks``, where a
block is held exactly when its ref count is above zero, and a cached block is exactly a
published one with ref count zero.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Hashable, Sequence


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns block ids ``0 .. num_blocks-1``; ``allocate`` and ``free`` keep ref counts.

    ``enable_caching``: freed published blocks stay findable until evicted (automatic prefix
    caching, vLLM's ``--enable-prefix-caching``). Off, a key lives exactly as long as its block's
    references (the n choices of one request still share their prompt: scheduling/prefix.py).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = False):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, holding nothing findable
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0, published: least recently freed first
        self._ref = [0] * num_blocks
        self._by_key: dict[Hashable, int] = {}  # published block contents -> the block holding them
        self._key_of: dict[int, Hashable] = {}
        # prefix cache counters (vLLM's prefix_cache_queries / _hits, in tokens): scheduling/prefix.py
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: the uncached free ones and the cached (evictable) ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a published prefix (evicted least recently freed first)."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """Requests holding the block (0: free, cached or not)."""
        return self._ref[block_id]

    def num_freed_by(self, block_lists: Sequence[Sequence[int]]) -> int:
        """Blocks that would become free if each list dropped its reference: a block shared with a
        holder not among them stays."""
        drops: dict[int, int] = {}
        for ids in block_lists:
            for b in ids:
                drops[b] = drops.get(b, 0) + 1
        return sum(n == self._ref[b] for b, n in drops.items())

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (ref count 1 each): uncached ones first, then cached
        ones, least recently freed first (their keys are dropped: evicted)."""
        if num_blocks > self.num_free:
            raise OutOfBlocks(f"asked for {num_blocks} blocks, {self.num_free} free")
        block_ids = []
        for _ in range(num_blocks):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._by_key[self._key_of.pop(b)]
                self.num_evictions += 1
            self._ref[b] = 1
            block_ids.append(b)
        return block_ids

    def share(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each block: one held already (prefix sharing, forks) or a cached one
        a lookup found (it leaves the eviction order while held)."""
        for b in block_ids:
            if self._ref[b] == 0:
                assert b in self._cached, f"block {b} is free and holds nothing published"
                del self._cached[b]
            self._ref[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. A block reaching zero is free: cached when it is
        published and caching is on, else back on the free list with its key dropped.

        A request's blocks are cached in reverse order, so eviction takes a sequence's tail
        before its head: the head is the part other prompts are likeliest to share."""
        newly_cached = []
        for b in block_ids:
            assert self._ref[b] > 0, f"double free of block {b}"
            self._ref[b] -= 1
            if self._ref[b] > 0:
                continue
            if self.enable_caching and b in self._key_of:
                newly_cached.append(b)
                continue
            self._free.append(b)
            key = self._key_of.pop(b, None)
            if key is not None:
                del self._by_key[key]
        for b in reversed(newly_cached):
            self._cached[b] = None

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
        A key already published, or a block already under a key, stays as it is (two requests
        that computed the same block: the first one's copy is the cached one)."""
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

    def count_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """The prefix cache's counters (monotonic): ``num_query_tokens`` prompt tokens looked up,
        ``num_hit_tokens`` found (scheduling/prefix.py decides what one prompt counts)."""
        assert num_query_tokens >= 0 and num_hit_tokens >= 0
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def reset_prefix_cache(self) -> int:
        """Forget every cached (unheld) block: they join the free list, their keys dropped.
        Held published blocks stay published. Returns the blocks forgotten."""
        n = len(self._cached)
        while self._cached:
            b, _ = self._cached.popitem(last=False)
            del self._by_key[self._key_of.pop(b)]
            self._free.append(b)
        return n

    def is_published(self, block_id: int) -> bool:
        return block_id in self._key_of

    @property
    def num_published(self) -> int:
        return len(self._by_key)

    def check(self) -> None:
        """Assert the invariants (tests): every block is held, free or cached, exactly once."""
        held = sum(r > 0 for r in self._ref)
        assert held + len(self._free) + len(self._cached) == self.num_blocks
        assert all(self._ref[b] == 0 and b not in self._key_of for b in self._free)
        assert all(self._ref[b] == 0 and b in self._key_of for b in self._cached)
        assert all(self._by_key[k] == b for b, k in self._key_of.items()) and len(self._by_key) == len(self._key_of)
        assert not self.enable_caching or all(self._ref[b] > 0 or b in self._cached for b in self._key_of)
