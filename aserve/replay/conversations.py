"""A multi-turn chat workload whose prompts share prefixes, written with Mooncake-style ``hash_ids``.

Conversation traffic resends its history every turn, and many conversations open with one of a few
system prompts. Each conversation here::

    turn 1 prompt:  [ system prompt s | user 1 ]
    turn 2 prompt:  [ system prompt s | user 1 | answer 1 | user 2 ]     (turn 1's prompt is its prefix)
    ...             until ``turns`` turns or the prompt would pass ``max_prompt_tokens``

Block ``i`` of a prompt (``hash_block`` tokens, the last one partial) is named by a hash id: the
system prompt's blocks by ids every conversation with that system prompt shares, the rest by ids
of the conversation's own, so a replay (``PromptBuilder``) gives equal ids equal tokens and a
prefix cache sees the reuse. A replay generates its own answers, so the trace's "answer" tokens
are not what the previous turn produced: a cache finds a turn's previous *prompt* (and the
system prompt), not the previous answer, as a replay of Mooncake's traces does.

User-turn and answer lengths are drawn from ShareGPT's length table; conversations start as a
Poisson process, and a turn follows the previous one's arrival after a think time (exponential,
mean ``think_s``): the arrivals are open-loop, as every trace's are.
"""
from __future__ import annotations

import random
from pathlib import Path

from aserve.replay.trace_formats import TraceRequest, read_lengths
from aserve.replay.workloads import SHAREGPT_LENGTHS

CHAT = "Chat"


def make_conversations(num_requests: int = 128, rate: float = 1.0, seed: int = 0,
                       lengths_path: Path = SHAREGPT_LENGTHS, num_system_prompts: int = 4,
                       system_tokens: tuple[int, int] = (256, 1024), turns: tuple[int, int] = (2, 6),
                       think_s: float = 20.0, max_prompt_tokens: int = 1536, max_user_tokens: int = 256,
                       max_output_tokens: int = 256, hash_block: int = 64) -> list[tuple[str, TraceRequest]]:
    """``num_requests`` ("Chat", request) pairs, sorted by arrival, ``rate`` requests/s on average."""
    if num_requests < 1 or rate <= 0 or hash_block < 1:
        raise ValueError(f"num_requests, rate and hash_block must be positive, got {num_requests}, {rate}, {hash_block}")
    if not Path(lengths_path).is_file():
        raise FileNotFoundError(f"ShareGPT length table not found: {lengths_path}")
    pool = [(min(r.prompt_tokens, max_user_tokens), min(r.output_tokens, max_output_tokens))
            for r in read_lengths(Path(lengths_path)).requests]
    rng = random.Random(seed)
    ids = iter(range(1 << 62))
    systems = []  # (tokens, hash ids of its whole blocks): a system prompt is whole blocks, so it is shared whole
    for _ in range(num_system_prompts):
        n = rng.randint(*system_tokens) // hash_block * hash_block or hash_block
        systems.append((n, [next(ids) for _ in range(n // hash_block)]))
    mean_turns = (turns[0] + turns[1]) / 2
    out, start = [], 0.0
    while len(out) < num_requests:
        start += rng.expovariate(rate / mean_turns)
        out.extend(_conversation(rng, ids, rng.choice(systems), pool, start, rng.randint(*turns), think_s,
                                 max_prompt_tokens, hash_block))
    out.sort(key=lambda r: r.arrival_s)
    return [(CHAT, r) for r in out[:num_requests]]


def _conversation(rng: random.Random, ids, system: tuple[int, list[int]], pool: list[tuple[int, int]],
                  start: float, num_turns: int, think_s: float, max_prompt: int, hash_block: int) -> list[TraceRequest]:
    """One conversation's turns: each prompt extends the previous prompt and its answer."""
    length, block_ids = system
    block_ids, t, reqs = list(block_ids), start, []
    for _ in range(num_turns):
        user, answer = rng.choice(pool)
        prompt = length + user
        if prompt > max_prompt:
            break
        while len(block_ids) * hash_block < prompt:  # the conversation's own blocks, named once
            block_ids.append(next(ids))
        reqs.append(TraceRequest(round(t, 6), prompt, answer, hash_ids=tuple(block_ids[:-(-prompt // hash_block)]),
                                 hash_block=hash_block))
        length = prompt + answer
        t += rng.expovariate(1 / think_s)
    return reqs
