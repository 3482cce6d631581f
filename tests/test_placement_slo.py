"""The SLO as placement reads it (scheduling/placement.py, issue 55): per-role token budgets and
TTFT-slack placement, on hand-made loads; pure, no torch, no cluster."""
from dataclasses import replace

import pytest

from scheduling.block_manager import BlockManager
from scheduling.decode import DecodeConfig
from scheduling.hybrid import HybridConfig, HybridScheduler
from scheduling.placement import EntryLoad, Placement, PlacementConfig
from scheduling.request import Request, SamplingParams

# a V100-like device: 40 ms a step, 0.4 ms a prompt token, 1 ms a decode row
COSTS = dict(token_budget=256, step_s=0.04, prefill_token_s=4e-4, decode_row_s=1e-3)
BALANCED = (0.0, 3.0, 5.0)  # the balanced corner's TTFT: 3 x prefill + 5 x step


def load(iid, role, queued=0, decodes=0, free=1000):
    return EntryLoad(iid, role, queued, decodes, free, 16)


def test_the_ttft_limit_is_the_corner_on_the_placement_costs():
    place = Placement(PlacementConfig(**COSTS, ttft_slo=BALANCED, slo_placement=True))
    assert place.ttft_limit_s(500) == pytest.approx(3 * (0.04 + 500 * 4e-4) + 5 * 0.04)
    assert Placement(PlacementConfig(**COSTS, ttft_slo=(0.25, 0, 0))).ttft_limit_s(500) == 0.25
    assert Placement(PlacementConfig(**COSTS)).ttft_limit_s(500) is None  # no SLO: by cost alone


def test_a_prompt_stays_off_the_decodes_while_the_prefill_side_keeps_its_slack():
    """By cost a 200-token prompt goes to the decode instance (its wait there is shorter than
    behind the prefill queue); under the SLO it goes where it slows no decode, since the queue
    still leaves it half its TTFT limit."""
    cost, slo = Placement(PlacementConfig(**COSTS)), Placement(PlacementConfig(**COSTS, ttft_slo=BALANCED, slo_placement=True))
    loads = [load("p0", "prefill", queued=200), load("d1", "decode", decodes=4)]
    assert slo.ttft_s(loads[0], 200) <= 0.5 * slo.ttft_limit_s(200)
    assert cost.choose(loads, 200).instance_id == "d1"
    assert slo.choose(loads, 200).instance_id == "p0"


def test_where_both_slow_no_decode_the_prefill_instance_comes_before_the_sooner_ttft():
    """An idle decode instance would start the prompt sooner than the prefill instance's short
    queue, and neither runs a decode: the prompt stays on the prefill side (the decode instance is
    where that side's requests decode next) while its TTFT keeps the slack and its queue fits the
    free blocks, and goes to the decode instance once either does not."""
    slo = Placement(PlacementConfig(**COSTS, ttft_slo=BALANCED, slo_placement=True))
    queue, idle = load("p0", "prefill", queued=150), load("d1", "decode")
    assert slo.ttft_s(idle, 200) < slo.ttft_s(queue, 200) <= 0.5 * slo.ttft_limit_s(200)
    assert slo.choose([queue, idle], 200).instance_id == "p0"
    long = load("p0", "prefill", queued=2000)
    assert slo.ttft_s(long, 200) > 0.5 * slo.ttft_limit_s(200)
    assert slo.choose([long, idle], 200).instance_id == "d1"
    # a prefill instance whose free blocks do not hold its queue and the prompt (a pool its kept
    # decodes fill) comes first no more: its queue waits for blocks, which its TTFT does not price
    full = load("p0", "prefill", queued=150, free=20)
    assert slo.ttft_s(full, 200) == slo.ttft_s(queue, 200) and not slo.queue_fits(full, 200)
    assert slo.queue_fits(queue, 200) and slo.choose([full, idle], 200).instance_id == "d1"


def test_past_the_slack_the_cheapest_instance_takes_it():
    slo = Placement(PlacementConfig(**COSTS, ttft_slo=BALANCED, slo_placement=True))
    cost = Placement(PlacementConfig(**COSTS))
    loads = [load("p0", "prefill", queued=4000), load("d1", "decode", decodes=4)]
    assert slo.ttft_s(loads[0], 200) > 0.5 * slo.ttft_limit_s(200)
    assert slo.choose(loads, 200).instance_id == cost.choose(loads, 200).instance_id == "d1"
    # of two decode instances within the slack, the one with fewer decodes to slow
    two = [load("p0", "prefill", queued=4000), load("d1", "decode", decodes=9), load("d2", "decode", decodes=3)]
    assert slo.choose(two, 200).instance_id == "d2"
    # a looser slack keeps it on the prefill side longer
    loose = Placement(PlacementConfig(**COSTS, ttft_slo=BALANCED, slo_placement=True, slack=1.0))
    mid = [load("p0", "prefill", queued=600), load("d1", "decode", decodes=4)]
    assert loose.choose(mid, 200).instance_id == "p0" and slo.choose(mid, 200).instance_id == "d1"


def test_late_binding_keeps_the_rule():
    """A decode instance takes a waiting prompt by cost; under the SLO only once its wait where it
    is no longer keeps the slack (then it still must cost a step less here)."""
    cost, slo = Placement(PlacementConfig(**COSTS)), Placement(PlacementConfig(**COSTS, ttft_slo=BALANCED, slo_placement=True))
    taker = load("d1", "decode", decodes=4)
    short, long = load("p0", "prefill", queued=200), load("p0", "prefill", queued=4000)
    assert cost.takes(taker, short, 200) and not slo.takes(taker, short, 200)
    assert slo.takes(taker, long, 200)
    # an instance with no more decodes to slow takes by cost alone; a dearer one never
    assert slo.takes(load("p1", "prefill"), short, 200) == cost.takes(load("p1", "prefill"), short, 200) is True
    assert not slo.takes(load("d2", "decode", queued=9000, decodes=4), short, 200)


def test_prefill_instances_have_their_own_budget():
    place = Placement(PlacementConfig(**{**COSTS, "prefill_token_budget": 1024}))
    assert place.budget("prefill") == 1024 and place.budget("decode") == 256
    assert place.share(load("p0", "prefill", decodes=24)) == 1000 and place.share(load("d1", "decode", decodes=6)) == 250
    assert Placement(PlacementConfig(**COSTS)).budget("prefill") == 256  # None: the one budget


TIGHT_TPOT = (0.0, 2.0)  # the tight-TPOT corner: 2 x a batch-1 decode step (0.041 s here)


def test_the_tpot_limit_is_the_corner_on_the_placement_costs():
    assert Placement(PlacementConfig(**COSTS, tpot_slo=TIGHT_TPOT)).tpot_limit_s() == pytest.approx(2 * 0.041)
    assert Placement(PlacementConfig(**COSTS, tpot_slo=(0.1, 0.0))).tpot_limit_s() == 0.1
    assert Placement(PlacementConfig(**COSTS)).tpot_limit_s() is None


def test_a_prompt_goes_where_its_chunks_push_no_running_decode_past_its_tpot():
    """A 200-token prompt's chunks add 0.08 s to each decode they run beside. The prefill instance
    holds a kept decode with 0.05 s of TPOT room left: by TTFT slack alone the prompt goes there
    (no queue), but that decode would miss, so it goes to the decode instance, whose decodes have
    room; where every instance would push one past, the fewest, then the rule as before."""
    ttft = Placement(PlacementConfig(**COSTS, ttft_slo=BALANCED, slo_placement=True))
    tpot = Placement(PlacementConfig(**COSTS, ttft_slo=BALANCED, slo_placement=True, tpot_slo=TIGHT_TPOT))
    kept = EntryLoad("p0", "prefill", 0, 1, 1000, 16, tpot_rooms=((0.05, 20),))
    roomy = EntryLoad("d1", "decode", 0, 3, 1000, 16, tpot_rooms=((0.5, 20),) * 3)
    assert tpot.tpot_misses(kept, 200) == 1 and tpot.tpot_misses(roomy, 200) == 0
    assert ttft.choose([kept, roomy], 200).instance_id == "p0"
    assert tpot.choose([kept, roomy], 200).instance_id == "d1"
    tight = EntryLoad("d1", "decode", 0, 3, 1000, 16, tpot_rooms=((0.01, 20),) * 3)
    assert tpot.choose([kept, tight], 200).instance_id == "p0"  # one pushed past against three
    # a decode with one token left sees one chunk of a long prompt (a share: 255 tokens, 0.102 s),
    # not all of its 0.8 s
    ending = EntryLoad("d1", "decode", 0, 1, 1000, 16, tpot_rooms=((0.2, 1),))
    assert tpot.tpot_misses(ending, 2000) == 0
    assert tpot.tpot_misses(replace(ending, tpot_rooms=((0.2, 20),)), 2000) == 1
    # one already pushed past by the prompts queued before it is not this prompt's doing
    behind = EntryLoad("d1", "decode", 300, 1, 1000, 16, tpot_rooms=((0.1, 20),))
    assert tpot.tpot_misses(behind, 200) == 0
    # no decodes with room: nothing to push past, the rule as before
    assert tpot.tpot_misses(load("d2", "decode", decodes=5), 200) == 0


def test_late_binding_never_takes_a_prompt_where_it_would_push_more_decodes_past_tpot():
    tpot = Placement(PlacementConfig(**COSTS, tpot_slo=TIGHT_TPOT))
    there = load("p0", "prefill", queued=4000)
    fragile = EntryLoad("d1", "decode", 0, 2, 1000, 16, tpot_rooms=((0.02, 30), (0.5, 30)))
    roomy = EntryLoad("d1", "decode", 0, 2, 1000, 16, tpot_rooms=((0.5, 30),) * 2)
    assert Placement(PlacementConfig(**COSTS)).takes(fragile, there, 200)  # by cost alone it would
    assert not tpot.takes(fragile, there, 200) and tpot.takes(roomy, there, 200)


@pytest.mark.parametrize("bad, match", [(dict(ttft_slo=(1.0, 2.0)), "ttft_slo is"), (dict(ttft_slo=(0, 0, 0)), "ttft_slo is"),
                                        (dict(ttft_slo=(-1.0, 0, 0)), "ttft_slo is"), (dict(slack=0), "slack must be"),
                                        (dict(slack=1.5), "slack must be"), (dict(prefill_token_budget=0), "token_budget"),
                                        (dict(slo_placement=True), "needs the TTFT SLO"),
                                        (dict(tpot_slo=(0.0, 0.0)), "tpot_slo is"), (dict(tpot_slo=(1.0,)), "tpot_slo is"),
                                        (dict(tpot_slo=(0.0, -2.0)), "tpot_slo is")])
def test_bad_slo_placement_settings_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        PlacementConfig(**bad)


def test_a_flip_brings_the_new_roles_budget():
    def req(rid, n):
        return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=20, ignore_eos=True))

    s = HybridScheduler(BlockManager(400, 16), DecodeConfig(), HybridConfig(token_budget=64, hand_over=True))
    s.set_hand_over(False, 32)
    assert s.hybrid.token_budget == 32 and not s.hybrid.hand_over
    s.set_hand_over(True)  # no budget given: the same
    assert s.hybrid.token_budget == 32 and s.hybrid.hand_over
    s.set_hand_over(False)
    s.add_request(req("d", 10))
    s.update(plan := s.schedule(), _sampled(plan))  # one decode running now
    s.add_request(req("long", 150))
    assert s.schedule().num_real_tokens <= 32


def _sampled(plan):
    from scheduling.step import StepOutput

    return StepOutput(sampled={q.request_id: 7 for q in plan.seqs if q.sampling is not None})


def test_deadline_order_admits_prompts_by_ttft_deadline_late_ones_last():
    from scheduling.clock import FakeClock

    def req(rid, n, deadline=None):
        r = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0)
        r.ttft_deadline = deadline
        return r

    clock = FakeClock(2.0)
    edf = HybridScheduler(BlockManager(400, 16), DecodeConfig(), HybridConfig(token_budget=4096, deadline_order=True),
                          clock)
    fifo = HybridScheduler(BlockManager(400, 16), DecodeConfig(), HybridConfig(token_budget=4096), clock)
    for s in (edf, fifo):
        for r in (req("late", 40, 1.0), req("loose", 40, 9.0), req("tight", 40, 3.0), req("none", 40)):
            s.add_request(r)
        s.schedule()
    assert fifo.running_ids == ["late", "loose", "tight", "none"]  # arrival order
    # no deadline known: first, in queue order; then earliest deadline; the late one (1.0 < now 2.0) last
    assert edf.running_ids == ["none", "tight", "loose", "late"]


def test_deadline_order_admits_the_earliest_within_the_blocks():
    """Earliest deadline first within the blocks there are: the later deadline waits for room."""
    from scheduling.clock import FakeClock

    clock = FakeClock(0.0)
    s = HybridScheduler(BlockManager(8, 16), DecodeConfig(), HybridConfig(token_budget=4096, deadline_order=True),
                        clock)
    big = Request("big", list(range(1, 121)), SamplingParams(max_tokens=4, ignore_eos=True))  # 8 blocks
    small = Request("small", list(range(1, 17)), SamplingParams(max_tokens=4, ignore_eos=True))
    big.ttft_deadline, small.ttft_deadline = 1.0, 5.0
    s.add_request(small)
    s.add_request(big)
    s.schedule()
    assert s.running_ids == ["big"] and s.waiting_ids == ["small"]  # earliest deadline first, though second


@pytest.mark.parametrize("edf", [False, True])
def test_deadline_order_gives_prompt_rows_by_deadline_a_chunk_at_a_time(edf):
    """With --slo-order, a prompt admitted behind a long one takes the step's prompt rows first where
    its TTFT deadline is sooner; the long one resumes after it from where it was (its KV kept), and
    one past its deadline goes last. Without it, admission order, as before."""
    from scheduling.clock import FakeClock

    def req(rid, n, deadline):
        r = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0)
        r.ttft_deadline = deadline
        return r

    clock = FakeClock(1.0)
    s = HybridScheduler(BlockManager(400, 16), DecodeConfig(), HybridConfig(token_budget=64, deadline_order=edf), clock)
    s.add_request(req("d", 10, None))
    s.update(plan := s.schedule(), _sampled(plan))  # one decode running: steps are chunked now
    s.add_request(req("long", 200, 9.0))
    s.update(plan := s.schedule(), _sampled(plan))  # the long prompt's first chunk (63 rows beside the decode)
    assert {q.request_id: q.end_pos - q.start_pos for q in plan.seqs} == {"d": 1, "long": 63}
    s.add_request(req("late", 40, 0.5))  # past its deadline already (now 1.0)
    s.add_request(req("short", 40, 2.0))
    rows = [(q.request_id, q.end_pos - q.start_pos) for q in s.schedule().seqs]
    if edf:  # the decode, then the earliest deadline still ahead, then the long one's next chunk
        assert rows == [("d", 1), ("short", 40), ("long", 23)]
    else:  # admission order: the long prompt takes the whole share
        assert rows == [("d", 1), ("long", 63)]
