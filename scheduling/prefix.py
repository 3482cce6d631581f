"""Prefix reuse: a request starts on KV blocks that already hold its first tokens.

Two users of one mechanism (the block manager's published keys, scheduling/block_manager.py):

- **Automatic prefix caching** (``BlockManager.enable_caching``, vLLM's ``--enable-prefix-caching``):
  every full block a step computes is published under a hash chained over all tokens up to its
  end and the request's ``cache_salt``; a request with no KV starts on the longest chain of
  published blocks of its tokens, held by others or cached after their holders ended.
- **The n choices of one request** (``prefix_group``, caching off): the API submits them as one
  group; the cluster holds all but the first until the first's prompt is in its KV blocks, then
  places them beside it (aserve/cluster/groups.py). Keys are chained from the group's name, so
  only siblings find each other's blocks, and only while some sibling holds them.

Either way a request that finds blocks takes a reference to each and its ``num_computed_tokens``
moves past them::

    first (computes the prompt):  [b0 b1 b2 | b3 ]   b3 holds the prompt's last token and its output
                                    │  │  │   (published once computed)
    a later one (shares b0..b2):  [b0 b1 b2 | b7 ]   computes from position 3 * block_size on: the
                                                     rest of the prompt (at least its last token,
                                                     whose row samples its own first token) into
                                                     a block of its own

Only full blocks before the one holding the request's last token are looked up, so no request
ever writes into a shared block: every write lands at a position >= its ``num_computed_tokens``,
past the shared ones, and copy-on-write is never needed. A published block is full and computed;
blocks are never rewritten while published (a block leaves the table before it is handed out
again). The block manager counts the references; a preemption, abort or hand-over frees one
holder's reference only. A request that asks for its prompt's log-probabilities (echo) computes
its whole prompt: its rows are what it asked for.

Keys are SHA-256 digests: Python's ``hash`` of a tuple of ints is easy to collide on purpose,
and a collision would hand one tenant another's KV. ``cache_salt`` enters the chain's root, so
two salts never share a block; no salt is a salt of its own.

Every scheduler calls ``share_prefix`` where a request with no KV first gets blocks, and
``publish_prefix`` once a step has computed a request's tokens (a decode instance also publishes
KV that arrives by a hand-over).
"""
from __future__ import annotations

import functools
import hashlib
from array import array

from scheduling.block_manager import BlockManager
from scheduling.request import Request


def shareable_blocks(request: Request, block_size: int, caching: bool = False) -> int:
    """Full blocks a request may start on: those before the block of its last token (the prompt's,
    or for a recompute, its last output token's). Without the cache only a group's prompt."""
    if request.sampling.prompt_logprobs is not None:
        return 0
    if caching:
        return (request.num_tokens - 1) // block_size
    if request.prefix_group is None:
        return 0
    return (request.num_prompt_tokens - 1) // block_size


def _root(request: Request, caching: bool, block_size: int) -> bytes:
    """The chain's first link: the salt (cache) or the group (no cache), and the block size."""
    name = f"salt:{request.cache_salt or ''}" if caching else f"group:{request.prefix_group}"
    return _link0(block_size, name)


@functools.lru_cache(maxsize=4096)
def _link0(block_size: int, name: str) -> bytes:
    """``_root``'s digest, made once per name (placement asks it of every instance per request)."""
    return hashlib.sha256(f"aserve-kv/{block_size}/{name}".encode()).digest()


def prefix_keys(request: Request, num_blocks: int, block_size: int, caching: bool = False) -> list[bytes]:
    """Keys of the request's first ``num_blocks`` full blocks, each a digest chained over the one
    before it and the block's tokens, so blocks of two sequences that differ anywhere before
    never match. Memoised on the request (its tokens only grow)."""
    root = _root(request, caching, block_size)
    memo = request.block_hashes
    if not memo or memo[0] != root:
        memo[:] = [root]
    while len(memo) <= num_blocks:
        i = len(memo) - 1
        tokens = request.token_ids_slice(i * block_size, (i + 1) * block_size)
        assert len(tokens) == block_size, "only full blocks have keys"
        memo.append(hashlib.sha256(memo[-1] + array("q", tokens).tobytes()).digest())
    return memo[1:num_blocks + 1]


def share_prefix(blocks: BlockManager, request: Request) -> int:
    """Start a request that holds no KV on the blocks published here that hold its first tokens:
    it takes a reference to each and its ``num_computed_tokens`` moves past them. Returns the
    blocks shared. With the cache on, a prompt's lookups count in the block manager's queries
    and hits (once per prompt: a later lookup before its first token replaces its count)."""
    if request.block_ids or request.num_computed_tokens:
        return 0
    caching = blocks.enable_caching
    n = shareable_blocks(request, blocks.block_size, caching)
    found = blocks.lookup(prefix_keys(request, n, blocks.block_size, caching)) if n else []
    if found:
        blocks.share(found)
        request.block_ids = list(found)
        request.num_computed_tokens = len(found) * blocks.block_size
    if caching and not request.output_token_ids:  # a prompt, not a recompute of prompt + output
        # counted once per prompt; a later lookup before its first token (the head of a queue that
        # found no room, a preemption) adds only what it finds beyond the first: counters never fall
        hit = len(found) * blocks.block_size
        before = request.num_cached_tokens
        blocks.count_lookup(request.num_prompt_tokens if before is None else 0, max(0, hit - (before or 0)))
        request.num_cached_tokens = hit
    return len(found)


def publish_prefix(blocks: BlockManager, request: Request, start_pos: int) -> None:
    """A step (or a hand-over) moved ``request`` from ``start_pos`` to its
    ``num_computed_tokens``: publish the full blocks that became computed. Without the cache
    only a group's shareable prompt blocks, once all are computed, for its siblings."""
    bs, caching = blocks.block_size, blocks.enable_caching
    if caching:
        lo, hi = start_pos // bs, request.num_computed_tokens // bs
        if hi <= lo:
            return
    else:
        hi = shareable_blocks(request, bs)
        if not hi or not start_pos < hi * bs <= request.num_computed_tokens:
            return
        lo = 0
    keys = prefix_keys(request, hi, bs, caching)
    blocks.publish(keys[lo:], request.block_ids[lo:hi])


def note_cached(blocks: BlockManager, request: Request) -> None:
    """As ``request`` joins a queue on ``blocks``' instance: remember how much of its prompt is
    cached there (``cached_prefix_tokens``, a look: nothing is taken; the hit is taken at its start)."""
    request.cached_hint = cached_prefix_tokens(blocks, request)


def uncached_left(request: Request, left: int) -> int:
    """``left`` tokens ``request`` still has to compute, less the cached prefix it was queued with
    while it has not started: an instance's queued work (what placement balances) counts the prompt
    tokens it will compute. Counted whole, a burst of prompts cached on one instance made that queue
    look like all their prompts, and entry placement sent every other one to an instance without the
    cache (guidellm's second run of the same prompts, 1,024 tokens each, at 8 streams: 4 of 8 hits;
    the misses waited 4.5-15 s for their prompts to be computed again)."""
    if request.cached_hint and not request.num_computed_tokens:
        return max(1, left - request.cached_hint)
    return left


def cached_prefix_tokens(blocks: BlockManager, request: Request) -> int:
    """Tokens of ``request`` a start here would find cached now (``share_prefix`` without taking
    anything): what placement weighs against an instance's load. 0 with the cache off."""
    if not blocks.enable_caching or request.block_ids or request.num_computed_tokens:
        return 0
    n = shareable_blocks(request, blocks.block_size, caching=True)
    return len(blocks.lookup(prefix_keys(request, n, blocks.block_size, caching=True))) * blocks.block_size if n else 0
