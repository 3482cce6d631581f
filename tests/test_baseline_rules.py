"""The coupled baselines' admission and preemption rules, one test per rule (docs/BASELINES.md)."""
from __future__ import annotations

import pytest

from scheduling import registry
from scheduling.block_manager import BlockManager
from scheduling.clock import FakeClock
from scheduling.coupled import BatchingConfig
from scheduling.request import Request, SamplingParams, Status
from scheduling.step import StepOutput

BS = 4


def make(policy: str, num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, watermark: float = 0.0):
    return registry.get("batching", policy)(BlockManager(num_blocks, BS), BatchingConfig(budget, max_seqs, watermark),
                                            FakeClock())


def req(rid: str, prompt: int, arrival: float = 0.0, max_tokens: int = 64) -> Request:
    return Request(rid, list(range(2, 2 + prompt)), SamplingParams(max_tokens=max_tokens), arrival_time=arrival)


def step(sched):
    """One step with token 1 for every request that catches up; the plan."""
    plan = sched.schedule()
    if not plan.empty:
        sched.update(plan, StepOutput({rid: 1 for rid in plan.sampled_ids}))
    return plan


def decode_only(sched, rids):
    """Run steps until the requests ``rids`` are all decoding (their prompts done)."""
    for _ in range(50):
        if all(sched.requests[r].num_uncomputed_tokens == 1 for r in rids):
            return
        step(sched)
    raise AssertionError("prompts did not finish")


# ---- vllm (prefill-first, Sarathi-Serve's vllm_scheduler.py) -----------------------------------------
def test_vllm_a_new_prompt_runs_alone_and_stalls_the_decodes():
    sched = make("vllm", budget=64)
    sched.add_request(req("a", 8))
    step(sched)
    assert step(sched).num_scheduled_tokens == {"a": 1}  # decoding
    sched.add_request(req("b", 8))
    plan = step(sched)
    assert plan.num_scheduled_tokens == {"b": 8}  # prompt-only iteration: a's decode waits


def test_vllm_prompts_are_whole_and_batched_up_to_the_budget():
    sched = make("vllm", budget=20)
    for rid, n in (("a", 8), ("b", 8), ("c", 8)):
        sched.add_request(req(rid, n))
    assert step(sched).num_scheduled_tokens == {"a": 8, "b": 8}  # c would pass the budget
    assert step(sched).num_scheduled_tokens == {"c": 8}
    big = make("vllm", budget=8)
    big.add_request(req("long", 30))
    assert step(big).num_scheduled_tokens == {"long": 30}  # a lone prompt over the budget runs whole


def test_vllm_and_sarathi_admit_only_with_the_whole_sequence_free_above_the_watermark():
    for policy in ("vllm", "sarathi"):
        sched = make(policy, num_blocks=100, budget=8, watermark=0.05)  # 5 blocks kept free
        sched.add_request(req("a", 4 * 90))  # 90 blocks: 100 - 90 = 10 >= 5, admitted
        sched.add_request(req("b", 4 * 6))  # 6 more would leave 4 < 5: waits
        step(sched)
        assert len(sched.requests["a"].block_ids) == 90, policy  # every prompt block at admission
        assert sched.requests["b"].status is Status.WAITING and not sched.requests["b"].block_ids, policy


def test_preemption_takes_the_latest_arrival_by_recompute():
    for policy in ("vllm", "sarathi"):
        sched = make(policy, num_blocks=6, budget=64)
        sched.add_request(req("old", 7, arrival=0.0))  # 2 blocks each, 8 tokens after the first
        sched.add_request(req("new", 7, arrival=1.0))
        decode_only(sched, ["old", "new"])
        sched.add_request(req("x", 3, arrival=2.0))  # takes the last block free
        while not sched.requests["x"].num_uncomputed_tokens == 1:
            step(sched)
        for _ in range(8):  # the decodes grow into new blocks: someone must go
            plan = step(sched)
            if plan.preempted_ids:
                break
        assert plan.preempted_ids[0] == "x", policy  # the latest arrival first
        x = sched.requests["x"]
        assert x.num_computed_tokens == 0 and not x.block_ids and x.status is Status.PREEMPTED, policy
        assert sched.waiting[0] is x, policy  # to the front of the queue


def test_a_readmitted_early_arrival_keeps_its_priority():
    """First come, first served by arrival: an old request re-admitted after a preemption is not
    the next victim just because it joined the batch last."""
    sched = make("vllm", num_blocks=8, budget=64)
    sched.add_request(req("old", 6, arrival=0.0))
    sched.add_request(req("new", 6, arrival=1.0))
    decode_only(sched, ["old", "new"])
    sched._preempt(sched.requests["old"], [])  # as a lack of blocks would; it waits at the front
    step(sched)  # re-admitted (recompute of prompt + output)
    assert [r.request_id for r in sched.running] == ["new", "old"]  # joined last...
    sched._sort_running()
    assert [r.request_id for r in sched.running] == ["old", "new"]  # ...but ranks first


# ---- sarathi (stall-free, Sarathi-Serve's sarathi_scheduler.py) --------------------------------------
def test_sarathi_every_decode_runs_in_every_step():
    sched = make("sarathi", budget=16)
    for rid in "abc":
        sched.add_request(req(rid, 4))
    decode_only(sched, list("abc"))
    sched.add_request(req("long", 60))
    for _ in range(4):
        plan = step(sched)
        assert {"a", "b", "c"} <= set(plan.num_scheduled_tokens)  # no decode waits for a prompt
        assert plan.num_real_tokens <= 16


def test_sarathi_chunks_admitted_prompts_before_new_ones():
    sched = make("sarathi", budget=10)
    sched.add_request(req("a", 25))
    assert step(sched).num_scheduled_tokens == {"a": 10}
    sched.add_request(req("b", 5))
    assert step(sched).num_scheduled_tokens == {"a": 10}  # a's next chunk first: b waits
    assert step(sched).num_scheduled_tokens == {"a": 5, "b": 5}  # the rest of the budget to b


def test_sarathi_admitted_chunks_need_no_new_blocks():
    sched = make("sarathi", num_blocks=20, budget=8)
    sched.add_request(req("a", 60))  # 15 blocks, all taken at admission
    step(sched)
    held = list(sched.requests["a"].block_ids)
    assert len(held) == 15
    while sched.requests["a"].num_uncomputed_tokens > 1:
        step(sched)
        assert sched.requests["a"].block_ids == held  # chunks run in blocks it already has


def test_blocks_return_after_everything_finishes():
    for policy in ("vllm", "sarathi"):
        sched = make(policy, num_blocks=30, budget=16)
        for i in range(6):
            sched.add_request(req(f"r{i}", 5 + 3 * i, arrival=float(i)))
        for _ in range(300):
            plan = step(sched)
            for r in list(sched.running):
                if r.num_output_tokens >= 6:
                    sched.finish(r, "length")
            if not sched.has_work():
                break
        assert not sched.has_work() and sched.blocks.num_free == sched.blocks.num_blocks, policy


def test_watermark_is_checked():
    with pytest.raises(ValueError, match="watermark"):
        BatchingConfig(watermark=1.0)
    sched = make("sarathi", num_blocks=100, watermark=0.05)
    with pytest.raises(ValueError, match="more KV blocks"):  # never admissible: refused at once
        sched.add_request(req("huge", 4 * 97))
