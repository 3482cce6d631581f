"""The n choices of one request compute its prompt once (vLLM's parallel sampling, by sharing).

The API submits a request's ``n`` choices of one prompt as ``n`` requests of one
``prefix_group``; the cluster holds all but the first until the first's prompt is in its KV
blocks, then places them beside it. Here, on that instance, each of them starts on the first's
blocks instead of computing its prompt::

    first (computes the prompt):  [b0 b1 b2 | b3 ]   b3 holds the prompt's last token and its output
                                    │  │  │   (published once computed, under the group's keys)
    a sibling (shares b0..b2):    [b0 b1 b2 | b7 ]   computes from position 3 * block_size on: the
                                                     rest of the prompt (at least its last token,
                                                     whose row samples its own first token) into
                                                     a block of its own

Only full blocks before the one holding the prompt's last token are shared, so no request ever
writes into a shared block: every write lands at a position >= its ``num_computed_tokens``, past
the shared ones, and copy-on-write is never needed. The block manager counts the references; a
preemption, abort or hand-over of one sibling frees its own reference, and the blocks stay while
any sibling holds them. A request that asks for its prompt's log-probabilities (echo) computes its
whole prompt: its rows are what it asked for.

Every scheduler calls ``share_prefix`` where a request with no KV first gets blocks, and
``publish_prefix`` once a step has computed a request's tokens.
"""
from __future__ import annotations

from scheduling.block_manager import BlockManager
from scheduling.request import Request


def shareable_blocks(request: Request, block_size: int) -> int:
    """Full prompt blocks a sibling may take: those before the block of the prompt's last token."""
    if request.prefix_group is None or request.sampling.prompt_logprobs is not None:
        return 0
    return (request.num_prompt_tokens - 1) // block_size


def prefix_keys(request: Request, num_blocks: int, block_size: int) -> list[tuple]:
    """Keys of the first ``num_blocks`` prompt blocks: the group, the block's index and a hash
    chained over every token up to the block's end, so blocks of two prompts that differ (a group
    misused) never match."""
    keys, chain = [], hash(request.prefix_group)
    ids = request.prompt_token_ids
    for i in range(num_blocks):
        chain = hash((chain, tuple(ids[i * block_size:(i + 1) * block_size])))
        keys.append((request.prefix_group, i, chain))
    return keys


def share_prefix(blocks: BlockManager, request: Request) -> int:
    """Start a request that holds no KV on the prompt blocks a sibling published here: it takes a
    reference to each and its ``num_computed_tokens`` moves past them. Returns the blocks shared."""
    if request.block_ids or request.num_computed_tokens:
        return 0
    n = shareable_blocks(request, blocks.block_size)
    if n == 0:
        return 0
    found = blocks.lookup(prefix_keys(request, n, blocks.block_size))
    if found:
        blocks.share(found)
        request.block_ids = list(found)
        request.num_computed_tokens = len(found) * blocks.block_size
    return len(found)


def publish_prefix(blocks: BlockManager, request: Request, start_pos: int) -> None:
    """A step moved ``request`` from ``start_pos`` to its ``num_computed_tokens``: once that
    crosses the end of its shareable blocks, publish them for its siblings."""
    n = shareable_blocks(request, blocks.block_size)
    end = n * blocks.block_size
    if n and start_pos < end <= request.num_computed_tokens:
        blocks.publish(prefix_keys(request, n, blocks.block_size), request.block_ids[:n])
