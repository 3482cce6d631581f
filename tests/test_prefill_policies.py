"""Prefill instance scheduler: FCFS/SJF/LJF groups, fixed-size chunk plans, blocks, abort."""
import random

import pytest

from scheduling.block_manager import BlockManager, blocks_needed
from scheduling.clock import FakeClock
from scheduling.prefill import PrefillConfig
from scheduling.registry import get
from scheduling.request import Request, Status
from scheduling.step import StepOutput


def make(policy="fcfs", num_blocks=256, block_size=4, **config):
    blocks = BlockManager(num_blocks, block_size)
    return get("prefill", policy)(blocks, PrefillConfig(**config), FakeClock())


def req(rid, num_prompt_tokens):
    return Request(rid, list(range(1, num_prompt_tokens + 1)))


def add_all(sched, lengths, prefix="r"):
    for i, n in enumerate(lengths):
        sched.add_request(req(f"{prefix}{i}", n))


def run_all(sched, max_chunks=10_000):
    """Schedule and update until nothing runs; hand-made first tokens. Returns the plans."""
    plans = []
    while not (plan := sched.schedule()).empty:
        sched.update(plan, first_tokens(plan))
        plans.append(plan)
        assert len(plans) < max_chunks
    return plans


def first_tokens(plan, token=7):
    return StepOutput({rid: token for rid in plan.sampled_ids})


def first_seen(plans):
    order = []
    for plan in plans:
        order += [s.request_id for s in plan.seqs if s.request_id not in order]
    return order


def assert_no_leak(sched):
    """Release finished prefills, abort the rest: the pool must be whole again."""
    for request in sched.finished_prefills:
        sched.release(request.request_id)
    for rid in sched.raw_ids + sched.scheduled_ids:
        sched.abort(rid)
    assert sched.blocks.num_free == sched.blocks.num_blocks
    assert not sched.has_work() and not sched.finished_prefills


def test_fcfs_keeps_arrival_order():
    sched = make("fcfs", chunk_size=8)
    add_all(sched, [30, 5, 20, 10])
    plans = run_all(sched)
    assert first_seen(plans) == ["r0", "r1", "r2", "r3"]
    assert [r.request_id for r in sched.finished_prefills] == ["r0", "r1", "r2", "r3"]
    assert_no_leak(sched)


@pytest.mark.parametrize("policy,expected", [
    ("sjf", ["r1", "r3", "r2", "r0", "r6", "r5", "r4"]),
    ("ljf", ["r0", "r2", "r3", "r1", "r4", "r5", "r6"]),
])
def test_sjf_ljf_order_within_each_sched_batch(policy, expected):
    sched = make(policy, chunk_size=16, sched_batch=4)
    add_all(sched, [30, 5, 20, 10, 40, 25, 3])  # groups: r0..r3 | r4..r6
    assert first_seen(run_all(sched)) == expected
    assert_no_leak(sched)


def test_sjf_long_prompt_is_not_starved_by_later_short_ones():
    sched = make("sjf", chunk_size=16, sched_batch=4)
    add_all(sched, [200, 3, 4, 5])
    first = sched.schedule()  # the group r0..r3 is now the scheduled queue
    sched.update(first, first_tokens(first))
    add_all(sched, [1] * 12, prefix="s")  # short arrivals after the group was formed
    plans = [first] + run_all(sched)
    order = first_seen(plans)
    assert order[:4] == ["r1", "r2", "r3", "r0"]
    done = [r.request_id for r in sched.finished_prefills]
    assert done.index("r0") < done.index("s0"), "the long prompt finishes within its group"
    assert_no_leak(sched)


def check_plans(plans, requests, chunk_size, pad):
    """Every plan within chunk_size; padding fills it exactly; slices contiguous and complete."""
    progress = {rid: 0 for rid in requests}
    for plan in plans:
        assert plan.num_real_tokens <= chunk_size
        expected = chunk_size if pad else plan.num_real_tokens
        assert plan.num_real_tokens + plan.num_pad_tokens == expected
        for s in plan.seqs:
            assert s.num_tokens > 0 and s.start_pos == progress[s.request_id]
            progress[s.request_id] = s.end_pos
            assert len(plan.block_ids[s.request_id]) >= blocks_needed(s.end_pos, 4)
    assert progress == {rid: r.num_prompt_tokens for rid, r in requests.items()}


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "ljf"])
def test_random_mixes_never_exceed_chunk_size(policy):
    rng = random.Random(1234)
    for _ in range(150):
        chunk_size, pad = rng.randint(1, 64), rng.random() < 0.5
        sched = make(policy, num_blocks=rng.randint(40, 300), chunk_size=chunk_size,
                     sched_batch=rng.randint(1, 8), pad=pad)
        requests = {f"r{i}": req(f"r{i}", rng.randint(1, 150)) for i in range(rng.randint(1, 12))}
        for r in requests.values():
            sched.add_request(r)
        plans = []
        while sched.has_work():  # release as the KV "leaves", so a small pool still drains
            plans += run_all(sched)
            for r in sched.finished_prefills:
                sched.release(r.request_id)
        check_plans(plans, requests, chunk_size, pad)
        assert_no_leak(sched)


def test_padding_is_counted_and_optional():
    sched = make(chunk_size=16)
    add_all(sched, [5, 6])
    (plan,) = run_all(sched)
    assert plan.num_scheduled_tokens == {"r0": 5, "r1": 6} and plan.num_pad_tokens == 5
    assert plan.sampled_ids == ("r0", "r1")
    assert_no_leak(sched)
    sched = make(chunk_size=16, pad=False)
    add_all(sched, [5, 6])
    (plan,) = run_all(sched)
    assert plan.num_real_tokens == 11 and plan.num_pad_tokens == 0
    assert_no_leak(sched)


def test_split_prompt_keeps_order_and_total():
    sched = make(chunk_size=16)
    add_all(sched, [40, 12])
    plans = run_all(sched)
    assert [[(s.request_id, s.start_pos, s.num_tokens) for s in p.seqs] for p in plans] == [
        [("r0", 0, 16)], [("r0", 16, 16)], [("r0", 32, 8), ("r1", 0, 8)], [("r1", 8, 4)]]
    assert [p.num_pad_tokens for p in plans] == [0, 0, 0, 12]
    assert [p.sampled_ids for p in plans] == [(), (), ("r0",), ("r1",)]
    r0 = sched.finished_prefills[0]
    assert r0.num_computed_tokens == 40 and r0.output_token_ids == [7]
    assert r0.status is Status.TRANSFERRING and len(r0.block_ids) == 10
    assert_no_leak(sched)


def test_out_of_blocks_stops_the_chunk_and_records_what_it_took():
    sched = make(num_blocks=4, block_size=4, chunk_size=32)  # the pool holds 16 tokens
    add_all(sched, [10, 10])
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"r0": 10, "r1": 4}  # r1 got the last block
    assert len(plan.block_ids["r0"]) == 3 and len(plan.block_ids["r1"]) == 1
    sched.update(plan, StepOutput({"r0": 7}))
    assert sched.blocks.num_free == 0 and sched.schedule().empty  # r1 waits
    sched.release("r0")
    plan = sched.schedule()
    assert [(s.request_id, s.start_pos, s.num_tokens) for s in plan.seqs] == [("r1", 4, 6)]
    sched.update(plan, StepOutput({"r1": 7}))
    assert_no_leak(sched)


def test_abort_from_every_queue_frees_blocks():
    sched = make(chunk_size=8, sched_batch=2)
    add_all(sched, [12, 4, 9, 3])
    plan = sched.schedule()  # r0[0:8) in flight; r1 scheduled; r2, r3 raw
    assert sched.raw_ids == ["r2", "r3"] and sched.scheduled_ids == ["r0", "r1"]
    assert sched.abort("r0").finish_reason == "abort"  # while its chunk runs
    assert sched.abort("r3").status is Status.FINISHED
    sched.update(plan, StepOutput({}))  # the aborted slice is skipped
    assert sched.abort("nope") is None
    run_all(sched)
    assert [r.request_id for r in sched.finished_prefills] == ["r1", "r2"]
    sched.abort("r1")
    assert_no_leak(sched)


def test_prompt_larger_than_pool_is_refused():
    sched = make(num_blocks=2, block_size=4)
    with pytest.raises(ValueError):
        sched.add_request(req("big", 9))
    assert_no_leak(sched)


def test_registry_names():
    assert get("prefill", "sjf").name == "sjf"
    with pytest.raises(ValueError, match="fcfs, sjf, ljf"):
        get("prefill", "lifo")
    with pytest.raises(ValueError, match="valid kinds"):
        get("coupled", "vllm")
