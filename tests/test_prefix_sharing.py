"""The n choices of one prompt share its KV blocks (scheduling/prefix.py), on every scheduler:
a sibling placed after the first one's prompt is computed starts on its blocks and computes only
the rest of the prompt (at least its last token), nobody writes into a shared block, a sibling's
preemption, abort or hand-over leaves the others' blocks alone, and every block (and every
published key) is back at the end. Integer blocks and hand-made outputs, no model."""
from __future__ import annotations

import random

import pytest

from scheduling.block_manager import BlockManager
from scheduling.clock import FakeClock
from scheduling.decode import DecodeConfig
from scheduling.hybrid import HybridConfig, HybridScheduler
from scheduling.prefill import PrefillConfig, PrefillScheduler
from scheduling.prefix import prefix_keys, shareable_blocks
from scheduling.request import Request, SamplingParams
from scheduling.step import StepOutput
from tests.test_batching_invariants import BLOCK_SIZE, FakeKV, Workload, assert_all_done, drive, make_scheduler

PROMPT = list(range(100, 137))  # 37 tokens: 9 full blocks of 4 before the block of its last token


def sibling(i: int, prompt=PROMPT, group: str = "g", max_tokens: int = 6, **sp) -> Request:
    return Request(f"c{i}", list(prompt), SamplingParams(max_tokens=max_tokens, **sp), prefix_group=group)


def step(sched, table: dict, kv: FakeKV) -> dict[str, int]:
    """One step with a fake model (token 1 for every sampled row); returns its rows."""
    plan = sched.schedule()
    kv.execute(plan, table, sched.blocks)
    rows = plan.num_scheduled_tokens
    sampled = {rid: 1 for rid, n in rows.items() if table[rid].num_computed_tokens + n == table[rid].num_tokens}
    sched.update(plan, StepOutput(sampled))
    return rows


def test_keys_cover_full_blocks_before_the_last_token_and_tell_prompts_apart():
    assert shareable_blocks(sibling(0), BLOCK_SIZE) == 9  # (37 - 1) // 4
    assert shareable_blocks(sibling(0, prompt=PROMPT[:36]), BLOCK_SIZE) == 8  # its last token ends block 8
    assert shareable_blocks(Request("x", PROMPT), BLOCK_SIZE) == 0  # no group: nothing shared
    assert shareable_blocks(sibling(0, prompt_logprobs=1), BLOCK_SIZE) == 0  # echo scores every prompt row
    a, b = prefix_keys(sibling(0), 9, BLOCK_SIZE), prefix_keys(sibling(1, prompt=PROMPT[:8] + [7] + PROMPT[9:]), 9, 4)
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:]))  # one token apart: every later key differs


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "alise"])
def test_coupled_siblings_share_the_prompt_and_survive_the_first_ones_abort(policy):
    sched, kv = make_scheduler(policy, num_blocks=64, budget=64, max_seqs=8, clock=FakeClock()), FakeKV(BLOCK_SIZE)
    reqs = [sibling(i) for i in range(4)]
    table = {r.request_id: r for r in reqs}
    sched.add_request(reqs[0])
    assert step(sched, table, kv) == {"c0": 37}  # the first computes the whole prompt
    for r in reqs[1:]:
        sched.add_request(r)
    rows = step(sched, table, kv)
    assert {rid: n for rid, n in rows.items() if rid != "c0"} == {"c1": 1, "c2": 1, "c3": 1}
    shared = reqs[0].block_ids[:9]
    for r in reqs[1:]:
        assert r.block_ids[:9] == shared and r.block_ids[9] != reqs[0].block_ids[9]
    assert all(sched.blocks.ref_count(b) == 4 for b in shared)
    sched.abort("c0")  # the first one's reference goes; the blocks stay for the others
    assert all(sched.blocks.ref_count(b) == 3 for b in shared)
    while sched.has_work():
        step(sched, table, kv)
        for r in list(sched.requests.values()):
            if r.num_output_tokens == r.sampling.max_tokens:
                sched.finish(r, "length")
    assert sched.blocks.num_free == sched.blocks.num_blocks and sched.blocks.num_published == 0


def test_prefill_instance_shares_and_hands_each_over_alone():
    """Disaggregated: siblings share the prefill instance's blocks; each is handed over (its
    whole KV copied out) and released on its own, the shared blocks freed with the last one."""
    sched = PrefillScheduler(BlockManager(32, BLOCK_SIZE), PrefillConfig(chunk_size=64))
    kv, reqs = FakeKV(BLOCK_SIZE), [sibling(i) for i in range(3)]
    table = {r.request_id: r for r in reqs}
    sched.add_request(reqs[0])
    assert step(sched, table, kv) == {"c0": 37}
    sched.add_request(reqs[1])
    sched.add_request(reqs[2])
    assert step(sched, table, kv) == {"c1": 1, "c2": 1}
    assert {r.request_id for r in sched.finished_prefills} == {"c0", "c1", "c2"}
    assert all(r.num_output_tokens == 1 for r in reqs)
    for r in reqs:
        sched.release(r.request_id)
    assert sched.blocks.num_free == 32 and sched.blocks.num_published == 0


def test_hybrid_sibling_ends_its_prompt_in_a_one_token_row_and_is_handed_over():
    """Adaptive, prefill role: a sibling's prompt ends in a one-token row; it is still a finished
    prompt (handed over, with its prefill time), not a decode kept on the prefill instance."""
    sched = HybridScheduler(BlockManager(32, BLOCK_SIZE), DecodeConfig(), HybridConfig(token_budget=64, hand_over=True))
    kv, reqs = FakeKV(BLOCK_SIZE), [sibling(i) for i in range(2)]
    table = {r.request_id: r for r in reqs}
    sched.add_request(reqs[0])
    step(sched, table, kv)
    sched.add_request(reqs[1])
    assert step(sched, table, kv) == {"c1": 1}
    assert [r.request_id for r in sched.finished_prefills] == ["c0", "c1"]
    assert "prefill_done" in reqs[1].times
    for r in reqs:
        sched.release(r.request_id)
    assert sched.blocks.num_free == 32


def test_no_sharing_for_echo_or_for_a_prompt_that_differs():
    sched, kv = make_scheduler("sarathi", num_blocks=64, budget=128), FakeKV(BLOCK_SIZE)
    first, echo = sibling(0), sibling(1, prompt_logprobs=0)
    other = sibling(2, prompt=PROMPT[:-1] + [5])  # same group, last token differs: blocks 0..8 still match
    wrong = sibling(3, prompt=[9] + PROMPT[1:])  # first token differs: nothing matches
    table = {r.request_id: r for r in (first, echo, other, wrong)}
    sched.add_request(first)
    step(sched, table, kv)
    for r in (echo, other, wrong):
        sched.add_request(r)
    rows = step(sched, table, kv)
    assert rows["c1"] == 37 and rows["c2"] == 1 and rows["c3"] == 37


def grouped_workload(seed: int, n: int = 24) -> Workload:
    """Groups of 1-5 siblings with one prompt each, a group's members arriving within a few
    steps of one another (some before the first's prompt is done, some after), a few aborted."""
    rng = random.Random(seed)
    reqs, targets, arrive, aborts = [], {}, {}, {}
    g = 0
    while len(reqs) < n:
        prompt = [rng.randint(2, 999) for _ in range(rng.randint(1, 40))]
        t0 = rng.randint(0, 40)
        for j in range(rng.randint(1, 5)):
            rid, target = f"g{g}-{j}", rng.randint(1, 20)
            reqs.append(Request(rid, prompt, SamplingParams(max_tokens=target + 2), prefix_group=f"g{g}"))
            targets[rid], arrive[rid] = target, t0 + rng.randint(0, 6)
            if rng.random() < 0.1:
                aborts[rid] = (arrive[rid] + rng.randint(0, 10), rng.random() < 0.5)
        g += 1
    return Workload(reqs, targets, arrive, aborts)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("policy", ["sarathi", "vllm", "alise"])
def test_grouped_load_under_block_pressure(policy, seed):
    """Random groups on a small pool (preemptions, ALISE's swaps and evictions): the fake KV sees
    every cached token where the scheduler says it is and no write into a shared block; every
    request ends with its target; blocks and keys return; and sharing happened."""
    sched, work = make_scheduler(policy, num_blocks=40, clock=FakeClock()), grouped_workload(seed)
    run = drive(sched, work, FakeClock())
    assert_all_done(sched, work)
    assert sched.blocks.num_published == 0
    first_row = {}  # each request's first row starts past 0 only on a sibling's blocks
    for plan in run.outputs:
        for s in plan.seqs:
            first_row.setdefault(s.request_id, s.start_pos)
    started_shared = [rid for rid, start in first_row.items() if start > 0]
    assert len(started_shared) >= 3, first_row
