"""Decode instance scheduler: continuous batching, admission policies, preemption, abort."""
import random

import pytest

from scheduling.block_manager import BlockManager, blocks_needed
from scheduling.clock import FakeClock
from scheduling.decode import DecodeConfig
from scheduling.registry import get
from scheduling.request import LengthRange, Request, SamplingParams, Status
from scheduling.step import StepOutput


def make(policy="greedy", num_blocks=256, block_size=4, **config):
    blocks = BlockManager(num_blocks, block_size)
    return get("decode", policy)(blocks, DecodeConfig(**config), FakeClock())


def arrive(sched, rid, num_prompt_tokens, max_tokens=64, predicted=None):
    """A request whose prompt KV has reached this instance, carrying its first token."""
    r = Request(rid, [1] * num_prompt_tokens, SamplingParams(max_tokens=max_tokens),
                predicted=predicted)
    r.num_computed_tokens, r.output_token_ids = num_prompt_tokens, [7]
    assert sched.allocate_incoming(r) is not None
    sched.accept_incoming(r)
    return r


def update(sched, plan, finished_ids=()):
    """Token 8 for everyone scheduled; ``finished_ids`` end there (the instance's stop check)."""
    events = sched.update(plan, StepOutput({rid: 8 for rid in plan.num_scheduled_tokens}))
    for r in events.tokens:
        if r.request_id in finished_ids:
            sched.finish(r, "stop")


def step(sched, finished_ids=()):
    plan = sched.schedule()
    if not plan.empty:
        update(sched, plan, finished_ids)
    return plan


def starts(plan):
    """Each scheduled request's first position in the step."""
    return {s.request_id: s.start_pos for s in plan.seqs}


def assert_no_leak(sched):
    for rid in sched.waiting_ids + sched.running_ids:
        sched.abort(rid)
    assert sched.blocks.num_free == sched.blocks.num_blocks
    assert sched.host.num_free == sched.host.num_blocks and not sched.swapped_ids


def test_continuous_batching_one_token_per_request_per_step():
    sched = make()
    a, b = arrive(sched, "a", 5), arrive(sched, "b", 9)
    s = step(sched)
    assert dict(s.num_scheduled_tokens) == {"a": 1, "b": 1}
    assert starts(s) == {"a": 5, "b": 9}
    assert a.output_token_ids == [7, 8] and a.num_computed_tokens == 6 and a.status is Status.RUNNING
    c = arrive(sched, "c", 3)  # joins the running batch at the next step
    s = step(sched, finished_ids=["a"])
    assert list(s.num_scheduled_tokens) == ["a", "b", "c"]
    assert a.status is Status.FINISHED and a.block_ids == [] and sched.running_ids == ["b", "c"]
    assert len(b.block_ids) == blocks_needed(b.num_tokens, 4) and c.num_output_tokens == 2
    assert_no_leak(sched)


def test_max_running_caps_the_batch():
    sched = make(max_running=2)
    for rid in "abc":
        arrive(sched, rid, 4)
    assert list(step(sched).num_scheduled_tokens) == ["a", "b"] and sched.waiting_ids == ["c"]
    assert_no_leak(sched)


def fill(sched, n=4):
    """n requests of 7 prompt tokens + 1 output: 2 blocks of 4 each; the next token needs a third."""
    return [arrive(sched, f"r{i}", 7) for i in range(n)]


def test_greedy_preempts_newest_by_recompute_when_blocks_run_out():
    sched = make(num_blocks=8)
    reqs = fill(sched)
    step(sched)  # 8 tokens each, in 2 blocks each: the pool is full
    s = step(sched)  # each needs a third block: r3's two go to r0 and r1, r2 preempts itself
    assert s.preempted_ids == ("r3", "r2") and list(s.num_scheduled_tokens) == ["r0", "r1"]
    r2 = reqs[2]
    assert r2.num_computed_tokens == 0 and r2.block_ids == [] and r2.num_preemptions == 1
    assert r2.status is Status.PREEMPTED and sched.waiting_ids == ["r2", "r3"]
    assert r2.output_token_ids == [7, 8]  # outputs stay; only the KV is gone
    step(sched, finished_ids=["r0", "r1"])
    s = step(sched)  # r2 reruns prompt + output in one step
    assert dict(s.num_scheduled_tokens) == {"r2": 9, "r3": 9} and starts(s)["r2"] == 0
    assert r2.num_computed_tokens == 9 and r2.num_tokens == 10
    assert_no_leak(sched)


def test_swap_reports_blocks_and_brings_them_back():
    sched = make(num_blocks=8, preemption="swap", num_swap_blocks=16)
    reqs = fill(sched)
    step(sched)
    held = list(reqs[3].block_ids)
    out = step(sched)
    assert out.preempted_ids == ("r3", "r2") and len(out.swap_out) == 4
    assert [device for device, _ in out.swap_out[:2]] == held
    assert set(sched.swapped_ids) == {"r2", "r3"} and sched.host.num_free == 12
    assert reqs[3].num_computed_tokens == 8 and reqs[3].block_ids == []  # progress kept
    step(sched, finished_ids=["r0", "r1"])
    back = step(sched)  # r2 first (it is older), then r3; one token each, no recompute
    assert dict(back.num_scheduled_tokens) == {"r2": 1, "r3": 1}
    host_order = [h for _, h in out.swap_out[2:]] + [h for _, h in out.swap_out[:2]]
    assert [host for host, _ in back.swap_in] == host_order
    assert [device for _, device in back.swap_in[2:]] == reqs[3].block_ids[:2]
    assert sched.host.num_free == 16 and not sched.swapped_ids
    assert_no_leak(sched)


def test_swap_without_host_space_falls_back_to_recompute():
    sched = make(num_blocks=8, preemption="swap", num_swap_blocks=2)
    reqs = fill(sched)
    step(sched)
    s = step(sched)
    assert s.preempted_ids == ("r3", "r2") and sched.swapped_ids == ["r3"]
    assert reqs[2].num_computed_tokens == 0 and len(s.swap_out) == 2
    assert_no_leak(sched)


def test_abort_frees_incoming_waiting_running_and_swapped():
    sched = make(num_blocks=8, preemption="swap", num_swap_blocks=16)
    fill(sched)
    step(sched), step(sched)  # r0, r1 running; r2, r3 swapped out and waiting; 2 blocks free
    late = Request("late", [1] * 4)
    late.num_computed_tokens = 4
    assert sched.allocate_incoming(late) is None  # swapped requests get blocks first
    assert sched.abort("r2").finish_reason == "abort" and sched.abort("r3").status is Status.FINISHED
    assert len(sched.allocate_incoming(late)) == 1 and sched.abort("r2") is None
    for rid in ["r0", "late"]:  # running, incoming
        assert sched.abort(rid).finish_reason == "abort"
    assert sched.running_ids == ["r1"] and not sched.swapped_ids and not sched.waiting_ids
    assert_no_leak(sched)


def test_load_counts_heavy_and_light():
    sched = make()
    arrive(sched, "h", 4, max_tokens=512, predicted=LengthRange(256, 512))
    arrive(sched, "l", 4, max_tokens=512, predicted=LengthRange(0, 64))
    arrive(sched, "n", 4, max_tokens=512)  # no prediction: max_tokens is the bound, heavy
    load = sched.load("d0")
    assert (load.num_heavy, load.num_light, load.free_blocks) == (2, 1, 256 - 3)
    assert_no_leak(sched)


def test_reserve_static_refuses_what_greedy_admits():
    for policy, admitted in [("greedy", ["a", "b"]), ("reserve-static", ["a"])]:
        sched = make(policy, num_blocks=40)
        arrive(sched, "a", 4, max_tokens=100, predicted=LengthRange(64, 100))  # ~26 blocks in all
        step(sched)
        arrive(sched, "b", 4, max_tokens=100, predicted=LengthRange(64, 100))
        step(sched)
        assert sched.running_ids == admitted, policy
        assert_no_leak(sched)


def test_reserve_dynamic_admits_when_the_shortest_job_frees_memory_in_time():
    for policy, admitted in [("reserve-static", ["a"]), ("reserve-dynamic", ["a", "b"])]:
        sched = make(policy, num_blocks=30)
        arrive(sched, "a", 4, max_tokens=100, predicted=LengthRange(0, 4))  # done in 3 tokens
        step(sched)
        arrive(sched, "b", 56, max_tokens=100, predicted=LengthRange(32, 64))  # 30 blocks in all
        step(sched)
        assert sched.running_ids == admitted, policy
        assert_no_leak(sched)


@pytest.mark.parametrize("policy", ["reserve-static", "reserve-dynamic"])
def test_a_request_past_its_prediction_reserves_up_to_max_tokens(policy):
    """"a" was predicted to end within 2 tokens and has 3: its prediction is refuted, so the
    policy holds it to max_tokens (as if never predicted). Held to its spent bound it would have
    one step to go, and a long newcomer would be admitted as greedily as under ``greedy``."""
    sched = make(policy, num_blocks=40)
    a = arrive(sched, "a", 4, max_tokens=100, predicted=LengthRange(0, 3))
    step(sched)
    step(sched)
    assert a.num_output_tokens == 3 and sched.running_ids == ["a"]
    # a may reach 104 tokens: 26 blocks, 24 more than it holds; 38 free leaves room for b's 14
    assert sched.reserved_blocks() == 24
    b = arrive(sched, "b", 56, max_tokens=100, predicted=LengthRange(32, 64))
    step(sched)
    assert sched.running_ids == ["a"] and b.status == Status.WAITING
    # the same batch with a's prediction still standing (a fresh request, 1 token) admits b
    fresh = make(policy, num_blocks=40)
    arrive(fresh, "a", 4, max_tokens=100, predicted=LengthRange(0, 3))
    arrive(fresh, "b", 56, max_tokens=100, predicted=LengthRange(32, 64))
    step(fresh)
    assert fresh.running_ids == ["a", "b"], policy
    assert_no_leak(sched)
    assert_no_leak(fresh)


def test_empty_batch_takes_a_request_the_policy_refuses():
    sched = make("reserve-static", num_blocks=10)
    r = arrive(sched, "big", 4, max_tokens=100)  # no prediction: 104 tokens, 26 blocks > 10
    step(sched)
    assert sched.running_ids == ["big"] and sched.num_forced_admissions == 1
    assert r.num_output_tokens == 2
    assert_no_leak(sched)


def bound(r):
    """Test-side restatement of the live output bound: hi - 1 within max_tokens, and max_tokens
    once the request has that many output tokens and still runs (the prediction is refuted)."""
    b = max(1, min(r.sampling.max_tokens, r.predicted.hi - 1))
    return max(1, r.sampling.max_tokens) if r.num_output_tokens >= b else b


def growth(r, bs, held):
    """Predicted total blocks (at least those of the next step) minus the blocks held."""
    total = max(blocks_needed(r.num_prompt_tokens + bound(r), bs), blocks_needed(r.num_tokens, bs))
    return max(0, total - held)


def dynamic_need(batch, bs, held):
    """Blocks the batch grows by until its shortest predicted job is done."""
    steps = min(max(1, bound(r) - r.num_output_tokens) for r in batch)
    need = 0
    for r in batch:
        at_end = blocks_needed(min(r.num_tokens + steps, r.max_total_tokens()), bs)
        need += max(0, at_end - held[r.request_id])
    return need


def check_admissions(policy, sched, before_running, admitted, held_before):
    """Replay each admission of one schedule: what the policy predicted must have fit."""
    bs = sched.blocks.block_size
    for i, a in enumerate(admitted):
        running = before_running + admitted[:i]
        if not running:
            continue  # an empty batch may take its head whatever the prediction
        # free blocks then = free now + what this and later admissions took
        free = sched.blocks.num_free + sum(
            len(x.block_ids) - held_before[x.request_id] for x in admitted[i:])
        held = {r.request_id: len(r.block_ids) for r in running}
        held[a.request_id] = held_before[a.request_id]
        if policy == "reserve-static":
            reserved = sum(growth(r, bs, held[r.request_id]) for r in running)
            assert growth(a, bs, held[a.request_id]) <= free - reserved
        else:
            assert dynamic_need(running + [a], bs, held) <= free


def random_arrival(rng, rid, wrong=0.0):
    """A prefilled request with a prediction, and the output length it will really have: within
    the predicted bucket, or with probability ``wrong`` past it (a refuted prediction)."""
    lo = rng.randint(0, 30)
    hi = max(3, lo + rng.randint(1, 30))
    r = Request(rid, [1] * rng.randint(1, 40), SamplingParams(max_tokens=64),
                predicted=LengthRange(lo, hi))
    r.num_computed_tokens, r.output_token_ids = r.num_prompt_tokens, [7]
    if rng.random() < wrong:
        return r, rng.randint(hi, 64)
    return r, rng.randint(max(2, lo), min(64, hi - 1))  # >= 2: one token came from prefill


@pytest.mark.parametrize("wrong", [0.0, 0.3])
@pytest.mark.parametrize("policy", ["reserve-static", "reserve-dynamic"])
def test_reserve_policies_never_admit_what_they_predict_will_not_fit(policy, wrong):
    """Every admission fits by the policy's own live bounds (``bound`` above), right predictions
    or not; with right ones reserve-static never preempts."""
    rng = random.Random(99)
    for _ in range(25):
        sched, target, reqs = make(policy, num_blocks=rng.randint(30, 120)), {}, {}
        for t in range(150):
            if t < 100 and rng.random() < 0.4:
                r, length = random_arrival(rng, f"r{t}", wrong)
                if sched.allocate_incoming(r) is not None:
                    sched.accept_incoming(r)
                    reqs[r.request_id], target[r.request_id] = r, length
            before = [reqs[rid] for rid in sched.running_ids]
            held_before = {rid: len(r.block_ids) for rid, r in reqs.items()}
            schedule = sched.schedule()
            admitted = [reqs[rid] for rid in schedule.num_scheduled_tokens
                        if rid not in {b.request_id for b in before}]
            check_admissions(policy, sched, before, admitted, held_before)
            if policy == "reserve-static" and not wrong and not sched.num_forced_admissions:
                assert not schedule.preempted_ids  # right predictions never overflow
            if not schedule.empty:
                ids = list(schedule.num_scheduled_tokens)
                done = [rid for rid in ids if reqs[rid].num_output_tokens + 1 >= target[rid]]
                update(sched, schedule, done)
        assert_no_leak(sched)
