"""Automatic prefix caching (scheduling/block_manager.py, scheduling/prefix.py), without a model.

The block manager's own rules first: a freed published block stays cached (ref count 0, still
counted free), a lookup hit takes it back, allocation takes uncached blocks before it evicts the
least recently freed cached one, and keys are SHA-256 chains over tokens and ``cache_salt``.
Then every scheduler over a caching pool under random load whose prompts share prefixes (system
prompts, later turns that resend earlier turns and their outputs): a fake KV that stores each
slot's *content* (salt and every token up to it) checks that every token a scheduler says is
cached is what that request would have computed, that nobody writes into a published or shared
block, that blocks come back to baseline (free + cached == total), that hits happen, and that a
request of another salt never gets one. Integer blocks and hand-made outputs, as vLLM's CPU
scheduler tests.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from scheduling import registry
from scheduling.alise import AliseConfig, AliseScheduler
from scheduling.block_manager import BlockManager
from scheduling.clock import FakeClock
from scheduling.coupled import BatchingConfig, VllmScheduler
from scheduling.decode import DecodeConfig, DecodeScheduler
from scheduling.hybrid import HybridConfig, HybridScheduler
from scheduling.prefill import PrefillConfig, PrefillScheduler
from scheduling.placement import EntryLoad, Placement, PlacementConfig, entry_key, entry_work
from scheduling.prefix import (cached_prefix_tokens, prefix_keys, publish_prefix, share_prefix, shareable_blocks,
                              uncached_left)
from scheduling.request import Request, SamplingParams
from scheduling.step import StepOutput

BS = 4


# ---- the block manager alone -------------------------------------------------------------------
def test_freed_published_blocks_stay_cached_and_count_as_free():
    bm = BlockManager(8, BS, enable_caching=True)
    a = bm.allocate(3)
    bm.publish(["k0", "k1"], a[:2])  # a[2] is a partial block: never published
    bm.free(a)
    assert bm.num_free == 8 and bm.num_cached == 2 and bm.num_published == 2
    assert bm.lookup(["k0", "k1", "k2"]) == a[:2]
    bm.share(a[:2])  # a hit: held again, out of the eviction order
    assert bm.ref_count(a[0]) == 1 and bm.num_cached == 0 and bm.num_free == 6
    bm.free(a[:2])
    bm.check()
    assert bm.num_free == 8 and bm.num_cached == 2


def test_without_caching_a_key_lives_only_as_long_as_its_holders():
    bm = BlockManager(8, BS)
    a = bm.allocate(2)
    bm.publish(["k0", "k1"], a)
    bm.share(a)  # a sibling
    bm.free(a)
    assert bm.lookup(["k0"]) == [a[0]]
    bm.free(a)
    assert bm.num_published == 0 and bm.num_cached == 0 and bm.lookup(["k0"]) == []
    bm.check()


def test_allocation_takes_uncached_blocks_first_then_evicts_least_recently_freed():
    bm = BlockManager(6, BS, enable_caching=True)
    old, new = bm.allocate(2), bm.allocate(2)
    bm.publish(["o0", "o1"], old)
    bm.publish(["n0", "n1"], new)
    bm.free(old)
    bm.free(new)
    got = bm.allocate(2)  # the two never-used blocks: nothing evicted
    assert not set(got) & set(old + new) and bm.num_evictions == 0 and bm.num_cached == 4
    # a sequence is cached tail first: its tail is evicted before its head
    assert bm.allocate(1) == [old[1]] and bm.lookup(["o0", "o1"]) == [old[0]]
    assert bm.allocate(1) == [old[0]] and bm.lookup(["o0"]) == []
    assert bm.lookup(["n0", "n1"]) == new and bm.num_evictions == 2
    bm.check()


def test_a_hit_refreshes_recency():
    bm = BlockManager(2, BS, enable_caching=True)
    a, b = bm.allocate(1), bm.allocate(1)
    bm.publish(["a"], a)
    bm.publish(["b"], b)
    bm.free(a)
    bm.free(b)
    bm.share(bm.lookup(["a"]))  # used again, freed again: now the most recent
    bm.free(a)
    assert bm.allocate(1) == b and bm.lookup(["a"]) == a


def test_a_block_is_published_once_and_a_duplicate_goes_back_uncached():
    bm = BlockManager(4, BS, enable_caching=True)
    a, b = bm.allocate(1), bm.allocate(1)
    bm.publish(["k"], a)
    bm.publish(["k"], b)  # computed twice (two requests missed in one step): the first copy is the cached one
    bm.free(b)
    assert bm.num_cached == 0 and bm.lookup(["k"]) == a
    bm.free(a)
    assert bm.reset_prefix_cache() == 1 and bm.num_published == 0 and bm.num_free == 4
    bm.check()


def test_out_of_blocks_only_when_cached_ones_are_gone_too():
    bm = BlockManager(3, BS, enable_caching=True)
    a = bm.allocate(3)
    bm.publish(["x", "y", "z"], a)
    bm.free(a)
    assert bm.can_allocate(3) and len(bm.allocate(3)) == 3 and bm.num_published == 0
    assert not bm.can_allocate(1)


# ---- keys ------------------------------------------------------------------------------------------
def req(rid, tokens, salt=None, out=(), max_tokens=8, **kw) -> Request:
    r = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0), cache_salt=salt, **kw)
    r.output_token_ids.extend(out)
    return r


def test_keys_chain_over_tokens_and_salt():
    p = list(range(10, 30))  # 5 full blocks
    k = prefix_keys(req("a", p), 5, BS, caching=True)
    assert k == prefix_keys(req("b", p), 5, BS, caching=True)  # content, not the request, names a block
    other = prefix_keys(req("c", p[:5] + [0] + p[6:]), 5, BS, caching=True)
    assert other[0] == k[0] and all(x != y for x, y in zip(other[1:], k[1:]))  # every block after a change differs
    salted = prefix_keys(req("d", p, salt="tenant"), 5, BS, caching=True)
    assert not set(salted) & set(k)
    assert not set(prefix_keys(req("e", p, prefix_group="g"), 5, BS)) & set(k)  # groups (no cache) are apart
    assert all(isinstance(x, bytes) and len(x) == 32 for x in k)  # SHA-256: collisions cannot be crafted
    # a later turn's keys extend an earlier turn's (prompt + output read as one sequence)
    turn = req("t", p[:6], out=p[6:12])
    assert prefix_keys(turn, 3, BS, caching=True) == k[:3]


def test_lookup_covers_full_blocks_before_the_last_token():
    assert shareable_blocks(req("a", range(8)), BS, caching=True) == 1  # 8 tokens: block 1 holds the last
    assert shareable_blocks(req("a", range(9)), BS, caching=True) == 2
    assert shareable_blocks(req("a", range(9), out=[1, 1]), BS, caching=True) == 2  # a recompute: 11 tokens
    assert shareable_blocks(req("a", range(9)), BS) == 0  # no cache, no group: nothing
    echo = Request("e", list(range(9)), SamplingParams(prompt_logprobs=0))
    assert shareable_blocks(echo, BS, caching=True) == 0  # its prompt rows are what it asked for


def compute(bm: BlockManager, r: Request) -> None:
    """What a scheduler and a step do: blocks for the rest, computed, published."""
    start = r.num_computed_tokens
    bm.grow(r.block_ids, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    publish_prefix(bm, r, start)


def test_share_prefix_starts_on_cached_blocks_and_counts_queries_and_hits():
    bm = BlockManager(16, BS, enable_caching=True)
    first = req("a", range(100, 118))  # 18 tokens: blocks 0..3 full
    assert share_prefix(bm, first) == 0
    compute(bm, first)
    bm.free(first.block_ids)
    assert bm.num_cached == 4
    later = req("b", list(range(100, 116)) + [7, 8, 9])  # 19 tokens: the first 16 are cached
    assert share_prefix(bm, later) == 4 and later.num_computed_tokens == 16 and later.num_cached_tokens == 16
    assert (bm.num_query_tokens, bm.num_hit_tokens) == (18 + 19, 16)
    same = req("c", range(100, 116))  # 16 tokens, all cached: its last block is computed anyway
    assert share_prefix(bm, same) == 3 and same.num_computed_tokens == 12
    other = req("d", range(100, 118), salt="tenant")
    assert share_prefix(bm, other) == 0 and other.num_cached_tokens == 0
    bm.check()


# ---- schedulers under random load ---------------------------------------------------------------
class ContentKV:
    """The runner's pool as slot -> what the slot holds: (salt, the tokens up to and including its
    position). A cached token must be exactly what this request would have computed there, and
    nobody writes into a block that is published or held by another request."""

    def __init__(self, bs: int):
        self.bs, self.device, self.host = bs, {}, {}

    def _copy(self, src, dst, pairs) -> None:
        for a, b in pairs:
            for off in range(self.bs):
                dst[b * self.bs + off] = src.get(a * self.bs + off)

    def execute(self, plan, table: dict, blocks: BlockManager) -> None:
        self._copy(self.device, self.host, plan.swap_out)
        self._copy(self.host, self.device, plan.swap_in)
        for rid, n in plan.num_scheduled_tokens.items():
            r = table[rid]
            seq = r.token_ids_slice(0, r.num_tokens)
            for pos in range(r.num_computed_tokens + n):
                block = r.block_ids[pos // self.bs]
                slot = block * self.bs + pos % self.bs
                want = (r.cache_salt, tuple(seq[:pos + 1]))
                if pos < r.num_computed_tokens:
                    assert self.device.get(slot) == want, f"{rid}: cached token {pos} is not its own"
                else:
                    assert blocks.ref_count(block) == 1, f"{rid} writes into shared block {block}"
                    assert not blocks.is_published(block), f"{rid} writes into published block {block}"
                    self.device[slot] = want


def conversation_workload(seed: int, n: int = 40, salts=(None, None, "t1")) -> tuple[list[Request], dict, dict]:
    """Requests with shared prefixes: one of three system prompts, and half of them a later turn
    of an earlier request (its prompt, its output as the fake model writes it: token 1s, and
    a few new tokens). Returns the requests, their output targets and arrival steps."""
    rng = random.Random(seed)
    systems = [[rng.randint(2, 999) for _ in range(rng.randint(4, 30))] for _ in range(3)]
    reqs, targets, arrive = [], {}, {}
    for i in range(n):
        target = rng.randint(1, 12)
        earlier = [r for r in reqs if r.num_prompt_tokens < 60]  # prompts stay within 80 tokens
        if earlier and rng.random() < 0.5:
            prev = rng.choice(earlier)
            prompt = prev.prompt_token_ids + [1] * targets[prev.request_id] + [rng.randint(2, 999) for _ in range(3)]
            salt, t0 = prev.cache_salt, arrive[prev.request_id] + rng.randint(5, 40)
        else:
            prompt = rng.choice(systems) + [rng.randint(2, 999) for _ in range(rng.randint(1, 12))]
            salt, t0 = rng.choice(salts), rng.randint(0, 60)
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=target + 2), cache_salt=salt)
        reqs.append(r)
        targets[r.request_id], arrive[r.request_id] = target, t0
    return reqs, targets, arrive


def run_coupled(sched, reqs, targets, arrive, kv=None, max_steps: int = 5000) -> list:
    """The engine loop over a coupled scheduler with the content-checking KV (pass the same one to
    runs after the first on one scheduler: it is the pool); returns the plans."""
    kv, table, plans = kv or ContentKV(BS), {r.request_id: r for r in reqs}, []
    pending = sorted(reqs, key=lambda r: arrive[r.request_id])
    step = 0
    while pending or sched.has_work():
        assert step < max_steps, "no progress"
        while pending and arrive[pending[0].request_id] <= step:
            sched.add_request(pending.pop(0))
        if sched.has_work():
            plan = sched.schedule()
            kv.execute(plan, table, sched.blocks)
            sampled = {rid: 1 for rid, n in plan.num_scheduled_tokens.items()
                       if table[rid].num_computed_tokens + n == table[rid].num_tokens}
            for r in sched.update(plan, StepOutput(sampled)).tokens:
                if r.num_output_tokens == targets[r.request_id]:
                    sched.finish(r, "stop")
            plans.append(plan)
            sched.blocks.check()
        if hasattr(sched, "clock") and isinstance(sched.clock, FakeClock):
            sched.clock.advance(0.04)
        step += 1
    return plans


def coupled(policy: str, num_blocks: int, caching: bool = True):
    blocks, batching, clock = BlockManager(num_blocks, BS, enable_caching=caching), BatchingConfig(32, 8), FakeClock()
    if policy == "alise":
        return AliseScheduler(blocks, batching, clock, alise=AliseConfig(aging_s=0.5, swap_after_s=0.5),
                              host_blocks=BlockManager(24, BS))
    return registry.get("batching", policy)(blocks, batching, clock)


def baseline(sched) -> None:
    """Every block back: free (uncached or cached) == total, nothing held, no request left."""
    bm = sched.blocks
    bm.check()
    assert bm.num_free == bm.num_blocks and bm.num_used == 0 and not sched.has_work()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["sarathi", "vllm", "alise"])
def test_coupled_policies_reuse_cached_prefixes_correctly(policy, seed):
    reqs, targets, arrive = conversation_workload(seed)
    sched = coupled(policy, num_blocks=200)
    run_coupled(sched, reqs, targets, arrive)
    baseline(sched)
    assert all(r.num_output_tokens == targets[r.request_id] for r in reqs)
    assert sched.blocks.num_hit_tokens > 0 and sched.blocks.num_cached > 0
    assert sched.blocks.num_query_tokens == sum(r.num_prompt_tokens for r in reqs)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy", ["sarathi", "vllm", "alise"])
def test_a_pool_too_small_to_keep_everything_still_serves_every_request(policy, seed):
    """Under pressure cached blocks are evicted (before preemption) and every request ends with
    its target, the content check holding throughout; the same run with no cache computes more."""
    reqs, targets, arrive = conversation_workload(seed, n=40)
    sched = coupled(policy, num_blocks=40)
    run_coupled(sched, reqs, targets, arrive)
    baseline(sched)
    assert all(r.num_output_tokens == targets[r.request_id] for r in reqs)
    assert sched.blocks.num_evictions > 0
    cold_reqs, _, _ = conversation_workload(seed, n=40)
    cold = coupled(policy, num_blocks=40, caching=False)
    run_coupled(cold, cold_reqs, targets, arrive)
    baseline(cold)
    assert cold.blocks.num_hit_tokens == 0 and cold.blocks.num_published == 0


def test_hits_come_back_once_there_is_room():
    sched, kv = coupled("sarathi", num_blocks=24), ContentKV(BS)
    prompt = list(range(200, 240))  # 10 blocks
    first = Request("a", prompt, SamplingParams(max_tokens=2))
    run_coupled(sched, [first], {"a": 2}, {"a": 0}, kv)
    assert sched.blocks.num_cached == 10
    hog = [Request(f"h{i}", [5 + i] * 30, SamplingParams(max_tokens=2)) for i in range(3)]
    run_coupled(sched, hog, {h.request_id: 2 for h in hog}, {h.request_id: 0 for h in hog}, kv)  # evicts most of it
    assert sched.blocks.num_evictions > 0
    again = Request("b", prompt, SamplingParams(max_tokens=2))
    run_coupled(sched, [again], {"b": 2}, {"b": 0}, kv)
    third = Request("c", prompt, SamplingParams(max_tokens=2))
    plans = run_coupled(sched, [third], {"c": 2}, {"c": 0}, kv)
    assert third.num_cached_tokens == 36 and plans[0].num_scheduled_tokens == {"c": 4}
    baseline(sched)


def test_another_salt_never_gets_a_hit():
    sched, kv = coupled("sarathi", num_blocks=64), ContentKV(BS)
    prompt = list(range(300, 330))
    a, b, c = (Request(rid, prompt, SamplingParams(max_tokens=2), cache_salt=s)
               for rid, s in (("a", "x"), ("b", "y"), ("c", "x")))
    run_coupled(sched, [a], {"a": 2}, {"a": 0}, kv)
    plans = run_coupled(sched, [b], {"b": 2}, {"b": 0}, kv)
    assert b.num_cached_tokens == 0 and plans[0].num_scheduled_tokens == {"b": 30}
    plans = run_coupled(sched, [c], {"c": 2}, {"c": 0}, kv)
    assert c.num_cached_tokens == 28 and plans[0].num_scheduled_tokens == {"c": 2}
    baseline(sched)


def test_a_recompute_after_preemption_starts_on_its_own_cached_blocks():
    sched = coupled("sarathi", num_blocks=64)
    r = Request("a", list(range(400, 421)), SamplingParams(max_tokens=20))
    sched.add_request(r)
    kv = ContentKV(BS)
    for _ in range(6):  # the prompt, then 5 decodes: 26 tokens, 6 full blocks
        plan = sched.schedule()
        kv.execute(plan, {"a": r}, sched.blocks)
        sched.update(plan, StepOutput({"a": 1}))
    sched._preempt(r, [])
    assert r.num_computed_tokens == 0 and sched.blocks.num_cached == 6
    plan = sched.schedule()
    kv.execute(plan, {"a": r}, sched.blocks)  # its cached prompt *and output* tokens are what it had
    assert plan.num_scheduled_tokens == {"a": 27 - 24}
    sched.update(plan, StepOutput({"a": 1}))
    sched.finish(r, "stop")
    baseline(sched)


# ---- disaggregated and adaptive roles -------------------------------------------------------------
def test_prefill_instance_computes_only_the_uncached_tail_and_its_decode_side_publishes():
    pre = PrefillScheduler(BlockManager(32, BS, enable_caching=True), PrefillConfig(chunk_size=64, pad=False))
    dec = DecodeScheduler(BlockManager(32, BS, enable_caching=True), DecodeConfig())
    kv_p, kv_d, system = ContentKV(BS), ContentKV(BS), list(range(500, 520))  # each instance its own pool
    a, b = Request("a", system + [1, 2, 3], SamplingParams(max_tokens=4)), Request("b", system + [7], SamplingParams(max_tokens=4))
    table = {"a": a, "b": b}
    for r in (a, b):
        pre.add_request(r)
        plan = pre.schedule()
        kv_p.execute(plan, table, pre.blocks)
        pre.update(plan, StepOutput({r.request_id: 1}))
        incoming = dec.allocate_incoming(r)  # the hand-over: reserve, copy, release, accept
        kv_d._copy(kv_p.device, kv_d.device, zip(r.block_ids, incoming))
        pre.release(r.request_id)
        dec.accept_incoming(r)
    plan = dec.schedule()  # both decode a token, reading their KV where it was copied
    kv_d.execute(plan, table, dec.blocks)
    dec.update(plan, StepOutput({rid: 1 for rid in plan.num_scheduled_tokens}))
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 20  # 21 tokens: 5 full blocks, the last computed
    assert pre.blocks.num_free == 32 and pre.blocks.num_cached == 5
    # on the decode side each request's full blocks were published when its KV arrived: a's 5
    # first, then b's 5 copies of the same content stayed unpublished (a's are the cached copy);
    # a's decode step filled its sixth block, published by the step
    assert dec.blocks.num_published == 6
    for rid in ("a", "b"):
        dec.abort(rid)
    baseline(pre)
    dec.blocks.check()
    assert dec.blocks.num_free == 32


def test_hybrid_scheduler_reuses_a_previous_turn_it_decoded():
    """Adaptive: the instance that decoded turn 1 holds its whole conversation; turn 2 placed
    there computes only its new tokens."""
    sched = HybridScheduler(BlockManager(64, BS, enable_caching=True), DecodeConfig(), HybridConfig(token_budget=64))
    kv, turn1 = ContentKV(BS), Request("t1", list(range(600, 630)), SamplingParams(max_tokens=10))
    table = {"t1": turn1}
    sched.add_request(turn1)
    while not turn1.finished:
        plan = sched.schedule()
        kv.execute(plan, table, sched.blocks)
        for r in sched.update(plan, StepOutput({"t1": 1})).tokens:
            if r.num_output_tokens == 10:
                sched.finish(r, "stop")
    turn2 = Request("t2", turn1.prompt_token_ids + [1] * 10 + [9, 9, 9], SamplingParams(max_tokens=2))
    table["t2"] = turn2
    sched.add_request(turn2)
    plan = sched.schedule()
    kv.execute(plan, table, sched.blocks)
    # 43 tokens: the first 39 were computed (30 prompt + 9 output tokens whose KV is in): 9 full blocks
    assert turn2.num_cached_tokens == 36 and plan.num_scheduled_tokens == {"t2": 7}
    sched.update(plan, StepOutput({"t2": 1}))
    sched.finish(turn2, "stop")
    baseline(sched)


# ---- placement that knows where prefixes live -------------------------------------------------------
def test_cached_prefix_tokens_looks_without_taking():
    bm = BlockManager(16, BS, enable_caching=True)
    first = req("a", range(100, 118))
    compute(bm, first)
    bm.free(first.block_ids)
    later = req("b", list(range(100, 116)) + [5])
    assert cached_prefix_tokens(bm, later) == 16 and bm.num_cached == 4 and not later.block_ids
    assert (bm.num_query_tokens, bm.num_hit_tokens) == (0, 0)  # a look is not a query
    assert cached_prefix_tokens(BlockManager(16, BS), later) == 0  # no cache, nothing to find


def test_entry_placement_ranks_kv_room_before_a_cached_prefix():
    # 2,000 tokens of history cached on a full pool lose to an empty instance with room
    full = entry_key(4, 2_000, cached_tokens=1_900, kv_outlook_blocks=20, expected_output_tokens=200, block_size=16)
    empty = entry_key(0, 2_000, cached_tokens=0, kv_outlook_blocks=160, expected_output_tokens=200, block_size=16)
    assert full == (138 - 20, 104) and empty == (0, 2_000) and empty < full
    # with room on both, the cached prefix wins as before (the least work)
    roomy = entry_key(4, 2_000, cached_tokens=1_900, kv_outlook_blocks=200, expected_output_tokens=200, block_size=16)
    assert roomy == (0, 104) < empty
    # a prefill instance (nothing decodes there) needs room for the prompt only
    assert entry_key(0, 2_000, 0, 125, 0, 16) == (0, 2_000) and entry_key(0, 2_000, 0, 124, 0, 16)[0] == 1


def test_coupled_kv_outlook_counts_what_running_requests_will_grow_to():
    bm = BlockManager(100, 16, enable_caching=True)
    sched = VllmScheduler(bm)
    assert sched.kv_outlook(64) == 100
    a = req("a", list(range(40)))  # 40 prompt tokens: 3 blocks now
    sched.add_request(a)
    assert sched.kv_outlook(64) == 100 - 7  # waiting: its whole 104 tokens (7 blocks) promised
    a.block_ids = bm.allocate(3)
    a.output_token_ids = [1] * 70  # already past the expected 64 out: one token more
    assert sched.kv_outlook(64) == 97 - (7 - 3)  # 40 + 71 = 111 tokens: 7 blocks, 3 of them held
    assert sched.kv_outlook(64, floor=95) == 95 and sched.kv_outlook(64, floor=90) == 93  # max(outlook, floor)
    sched.finish(a, "stop")
    assert sched.kv_outlook(64) == 100


def test_placement_weighs_a_cached_prefix_against_load():
    # coupled and disagg entry: the least work with the prompt placed there
    assert entry_work(100, 500, cached_tokens=480) == 120 < entry_work(0, 500) == 500
    assert entry_work(0, 500, cached_tokens=500) == 1  # the last token is always computed
    # adaptive: the same prices, the prompt's cached part costs nothing
    place = Placement(PlacementConfig(token_budget=256, step_s=0.01, prefill_token_s=1e-3, decode_row_s=1e-3))
    cold = EntryLoad("p0", "prefill", queued_tokens=200, num_decodes=0, free_blocks=100, block_size=16)
    warm = EntryLoad("d0", "decode", queued_tokens=0, num_decodes=4, free_blocks=100, block_size=16, cached_tokens=900)
    assert place.choose([cold, warm], 1000).instance_id == "d0"  # the previous turn's KV is there
    assert place.choose([cold, replace(warm, cached_tokens=0)], 1000).instance_id == "p0"
    busy = replace(warm, queued_tokens=5000)
    assert place.choose([cold, busy], 1000).instance_id == "p0"  # a long queue outweighs the hit


@pytest.mark.parametrize("role", ["coupled", "prefill"])
def test_a_queue_counts_only_the_uncached_part_of_its_waiting_prompts(role):
    """An instance's queued work (what entry placement balances) counts a waiting prompt less the
    prefix cached there when it joined; once it starts, its own progress counts. Counted whole, a
    burst of prompts all cached on one instance looked like that many prompts to compute there,
    and placement sent every other one to an instance without the cache."""
    def scheduler():
        bm = BlockManager(64, BS, enable_caching=True)
        return VllmScheduler(bm) if role == "coupled" else PrefillScheduler(bm, PrefillConfig())

    warm, cold = scheduler(), scheduler()
    seen = req("seen", range(100, 141))  # 41 tokens: 40 in full blocks
    compute(warm.blocks, seen)
    warm.blocks.free(seen.block_ids)
    again = [req(f"r{i}", range(100, 141)) for i in range(4)]
    for r in again:
        warm.add_request(r)
        assert r.cached_hint == 40 and uncached_left(r, 41) == 1
    assert warm.num_queued_tokens == 4  # nothing runs yet; each leaves its last token to compute
    fresh = req("fresh", range(100, 141))
    cold.add_request(fresh)
    assert fresh.cached_hint == 0 and cold.num_queued_tokens == 41  # no cache there: the whole prompt
    # started: its own progress counts, not the hint
    again[0].num_computed_tokens = 20
    assert uncached_left(again[0], 21) == 21
