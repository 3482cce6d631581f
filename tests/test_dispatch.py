"""Dispatch of finished prefills to decode instances, over real decode schedulers' loads."""
import random

import pytest

from scheduling.block_manager import BlockManager
from scheduling.clock import FakeClock
from scheduling.decode import DecodeConfig
from scheduling.dispatch import (DecodeLoad, DispatchConfig, NoDecodeInstance, is_heavy,
                                 predicted_max_output)
from scheduling.prefill import PrefillConfig
from scheduling import registry
from scheduling.registry import get
from scheduling.step import StepOutput
from scheduling.request import LengthRange, Request, SamplingParams

HEAVY, LIGHT = LengthRange(256, 512, bucket=2), LengthRange(0, 64, bucket=0)


def pools(n=4, num_blocks=400, block_size=16):
    greedy = get("decode", "greedy")
    return {f"d{i}": greedy(BlockManager(num_blocks, block_size), DecodeConfig(), FakeClock())
            for i in range(n)}


def broadcast(dispatcher, decoders):
    dispatcher.update_loads([sched.load(iid) for iid, sched in decoders.items()])


def prefilled(rid, num_prompt_tokens, predicted, max_tokens=512):
    """A request as it leaves its prefill instance: prompt computed, first token sampled."""
    r = Request(rid, [1] * num_prompt_tokens, SamplingParams(max_tokens=max_tokens),
                predicted=predicted)
    r.num_computed_tokens, r.output_token_ids = num_prompt_tokens, [7]
    return r


def send(decoder, request):
    assert decoder.allocate_incoming(request) is not None
    decoder.accept_incoming(request)  # the KV copy itself is netemu's business


def assert_no_leak(decoders):
    for sched in decoders.values():
        for rid in sched.waiting_ids + sched.running_ids:
            sched.abort(rid)
        assert sched.blocks.num_free == sched.blocks.num_blocks and not sched.has_work()


def dispatch_mixed(policy, decoders, seed=0, broadcast_every=8):
    dispatcher = get("dispatch", policy)(DispatchConfig(seed=seed))
    rng = random.Random(seed)
    kinds = [True] * 32 + [False] * 32
    rng.shuffle(kinds)
    for i, heavy in enumerate(kinds):
        if i % broadcast_every == 0:
            broadcast(dispatcher, decoders)
        r = prefilled(f"r{i}", rng.randint(8, 200), HEAVY if heavy else LIGHT)
        send(decoders[dispatcher.choose(r)], r)
    return [sched.load(iid).num_heavy for iid, sched in decoders.items()]


def test_interference_spreads_heavy_decodes():
    decoders = pools()
    heavy = dispatch_mixed("interference", decoders)
    assert sum(heavy) == 32 and max(heavy) - min(heavy) <= 2, heavy
    assert_no_leak(decoders)


def test_imbalance_piles_heavy_decodes_on_one_instance():
    decoders = pools()
    assert dispatch_mixed("imbalance", decoders) == [32, 0, 0, 0]
    assert_no_leak(decoders)


def test_instances_without_room_are_avoided():
    dispatcher = get("dispatch", "interference")(DispatchConfig(seed=3))
    tight = [DecodeLoad(f"d{i}", 10, 400, 0, 0, 16) for i in range(3)]
    r = prefilled("r", 100, HEAVY)  # (100 + 511) tokens -> 39 blocks
    for _ in range(50):
        dispatcher.update_loads(tight + [DecodeLoad("d3", 100, 400, 9, 0, 16)])
        assert dispatcher.choose(r) == "d3"  # the only one with room, heavy as it is
    dispatcher.update_loads([DecodeLoad("d0", 10, 400, 0, 0, 16), DecodeLoad("d1", 30, 400, 0, 0, 16)])
    assert dispatcher.choose(r) == "d1"  # nobody has room: most free blocks


@pytest.mark.parametrize("policy", registry.names("dispatch"))
def test_instances_left_out_of_the_broadcast_are_never_chosen(policy):
    """The cluster broadcasts active decode instances only: a draining or failed one drops out."""
    decoders = pools(3)
    dispatcher = get("dispatch", policy)(DispatchConfig(seed=1))
    live = {iid: d for iid, d in decoders.items() if iid != "d0"}  # the first by id: imbalance's heavy target too
    broadcast(dispatcher, live)
    rng = random.Random(5)
    for i in range(60):
        r = prefilled(f"r{i}", rng.randint(1, 64), rng.choice([HEAVY, LIGHT]))
        assert dispatcher.choose(r) != "d0"
    broadcast(dispatcher, {})
    with pytest.raises(NoDecodeInstance):
        dispatcher.choose(prefilled("x", 4, LIGHT))
    broadcast(dispatcher, {"d2": decoders["d2"]})
    assert dispatcher.choose(prefilled("y", 4, LIGHT)) == "d2"
    assert_no_leak(decoders)


def test_view_counts_own_dispatches_until_next_broadcast():
    dispatcher = get("dispatch", "least-loaded")()
    equal = [DecodeLoad(f"d{i}", 100, 100, 0, 0, 16) for i in range(4)]
    dispatcher.update_loads(equal)
    burst = [dispatcher.choose(prefilled(f"r{i}", 16, LIGHT)) for i in range(4)]
    assert sorted(burst) == ["d0", "d1", "d2", "d3"]  # not all to the emptiest-looking one
    assert [load.num_light for load in dispatcher.view()] == [1, 1, 1, 1]
    assert dispatcher.view()[0].free_blocks == 100 - 5  # (16 + 63) tokens -> 5 blocks
    dispatcher.update_loads(equal)  # a broadcast replaces the view
    assert dispatcher.view() == tuple(equal)


def test_round_robin_and_random_are_deterministic():
    loads = [DecodeLoad(f"d{i}", 100, 100, 0, 0, 16) for i in range(3)]
    rr = get("dispatch", "round-robin")()
    rr.update_loads(loads)
    assert [rr.choose(prefilled(f"r{i}", 4, LIGHT)) for i in range(4)] == ["d0", "d1", "d2", "d0"]
    picks = []
    for _ in range(2):
        rnd = get("dispatch", "random")(DispatchConfig(seed=9))
        rnd.update_loads(loads)
        picks.append([rnd.choose(prefilled(f"r{i}", 4, LIGHT)) for i in range(20)])
    assert picks[0] == picks[1] and len(set(picks[0])) == 3


def test_predicted_bound_and_heavy_threshold():
    assert predicted_max_output(prefilled("a", 4, None, max_tokens=300)) == 300  # no predictor
    assert predicted_max_output(prefilled("b", 4, LengthRange(0, 64))) == 63  # [lo, hi)
    assert predicted_max_output(prefilled("c", 4, HEAVY, max_tokens=100)) == 100  # capped
    assert not is_heavy(prefilled("d", 4, LengthRange(0, 129)), 128)
    assert is_heavy(prefilled("e", 4, LengthRange(128, 130)), 128)
    assert is_heavy(prefilled("f", 4, None, max_tokens=129), 128)


def test_prefill_dispatch_decode_end_to_end_leaves_no_blocks():
    clock = FakeClock()
    config = PrefillConfig(chunk_size=64, sched_batch=4)
    prefill = get("prefill", "sjf")(BlockManager(128, 16), config, clock)
    decoders = pools(3, num_blocks=64)
    dispatcher = get("dispatch", "interference")()
    rng = random.Random(11)
    target, requests = {}, {}
    for i in range(12):
        r = Request(f"r{i}", [1] * rng.randint(1, 100), SamplingParams(max_tokens=rng.randint(2, 40)))
        target[r.request_id], requests[r.request_id] = rng.randint(2, r.sampling.max_tokens), r
        prefill.add_request(r)
    finished = []
    while prefill.has_work() or any(d.has_work() for d in decoders.values()):
        broadcast(dispatcher, decoders)
        if not (plan := prefill.schedule()).empty:
            for r in prefill.update(plan, StepOutput({rid: 7 for rid in plan.sampled_ids})).prefilled:
                decoder = decoders[dispatcher.choose(r)]
                assert decoder.allocate_incoming(r) is not None
                prefill.release(r.request_id)  # KV copied: the prefill side lets go first
                decoder.accept_incoming(r)
        for decoder in decoders.values():
            finished += step(decoder, requests, target)
        clock.advance(0.01)
    assert sorted(r.request_id for r in finished) == sorted(target)
    assert all(r.num_output_tokens == target[r.request_id] for r in finished)
    assert prefill.blocks.num_free == prefill.blocks.num_blocks
    assert_no_leak(decoders)


def step(decoder, requests, target):
    """One decode step with hand-made tokens; a request stops at its target length (>= 2: the
    first token came from the prefill instance)."""
    schedule = decoder.schedule()
    if schedule.empty:
        return []
    events = decoder.update(schedule, StepOutput({rid: 8 for rid in schedule.num_scheduled_tokens}))
    done = [r for r in events.tokens if r.num_output_tokens >= target[r.request_id]]
    for r in done:
        decoder.finish(r, "stop")
    return done
