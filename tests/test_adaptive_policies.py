"""Adaptive mode's policies without an engine (issue 24): the global placement's choice between a
prefill and a decode instance from given loads, the prefill instance's keep-or-hand-over rule,
the hybrid scheduler's budgeted chunks beside decodes, and ratio flips' hysteresis band and
per-instance dwell on a fake clock."""
from dataclasses import replace

import pytest

from scheduling.block_manager import BlockManager
from scheduling.clock import FakeClock
from scheduling.decode import DecodeConfig
from scheduling.flip import InstanceView, RatioFlipPolicy
from scheduling.hybrid import HybridConfig, HybridScheduler
from scheduling.placement import EntryLoad, Placement, PlacementConfig
from scheduling.request import Request, SamplingParams
from scheduling.step import StepOutput

# a CPU-like device: 10 ms a step, 1 ms a prompt token, 1 ms a decode row; budget 256
PLACE = Placement(PlacementConfig(token_budget=256, step_s=0.01, prefill_token_s=1e-3, decode_row_s=1e-3,
                                  interference=0.3))


def load(iid, role, queued=0, decodes=0, free=1000):
    return EntryLoad(iid, role, queued, decodes, free, 16)


# ---- placement -------------------------------------------------------------------------------
def test_a_prompt_goes_to_an_idle_prefill_instance_before_a_busy_decode_instance():
    loads = [load("p0", "prefill"), load("d1", "decode", decodes=30)]
    assert PLACE.choose(loads, 100).instance_id == "p0"
    assert PLACE.choose(loads, 1000).instance_id == "p0"


def test_a_backlogged_prefill_side_sends_prompts_to_the_decode_instance():
    loads = [load("p0", "prefill", queued=8000), load("d1", "decode", decodes=10)]
    chosen = PLACE.choose(loads, 200)
    assert chosen.instance_id == "d1"
    # its cost there is its wait beside 10 decodes plus what it adds to them, both under p0's queue
    assert PLACE.cost_s(loads[1], 200) < PLACE.ttft_s(loads[0], 200)


def test_the_choice_follows_the_estimates_not_a_prompt_length():
    """The same prompt flips side as the prefill queue grows past what the decodes' slowdown costs."""
    decode = load("d1", "decode", decodes=20)
    sides = [PLACE.choose([load("p0", "prefill", queued=q), decode], 500).role for q in (0, 500, 2000, 8000)]
    assert sides[0] == "prefill" and sides[-1] == "decode"
    assert sides == sorted(sides, key=("prefill", "decode").index)  # one switch, at some queue length


def test_a_decode_instance_without_room_is_never_chosen():
    loads = [load("p0", "prefill", queued=50_000), load("d1", "decode", free=3)]
    assert PLACE.choose(loads, 200).instance_id == "p0"
    assert PLACE.choose([load("d1", "decode", free=3)], 200) is None


def test_keep_or_hand_over():
    # an idle prefill instance with fewer decodes than the decode instance keeps what it prefilled
    assert PLACE.keep_local(load("p0", "prefill", decodes=1), [load("d1", "decode", decodes=5)], 4)
    # --keep-margin 2: within 2 of the least busy decode instance: keep; far above it: hand over
    margin2 = Placement(PlacementConfig(keep_margin=2))
    assert margin2.keep_local(load("p0", "prefill", decodes=3), [load("d1", "decode", decodes=2)], 4)
    assert not margin2.keep_local(load("p0", "prefill", decodes=6), [load("d1", "decode", decodes=2)], 4)
    # no decode instance has room for its KV: keep it rather than let it wait
    assert PLACE.keep_local(load("p0", "prefill", decodes=9), [load("d1", "decode", decodes=0, free=3)], 4)
    # --keep-margin 1: one decode more than the least busy decode instance is enough to hand over
    eager = Placement(PlacementConfig(keep_margin=1))
    assert eager.keep_local(load("p0", "prefill", decodes=2), [load("d1", "decode", decodes=2)], 4)
    assert not eager.keep_local(load("p0", "prefill", decodes=3), [load("d1", "decode", decodes=2)], 4)



def test_keep_or_hand_over_priced():
    # keep_margin None: hand over when the request and its neighbours save more than a token gap
    priced = Placement(PlacementConfig(token_budget=256, step_s=0.01, prefill_token_s=1e-3, decode_row_s=1e-3))
    assert priced.config.keep_margin is None
    p, d = load("p0", "prefill", decodes=3), load("d1", "decode", decodes=3)
    assert priced.keep_local(p, [d], 4, expected_tokens=500)  # nothing to even out: the move only costs
    p4, d2 = load("p0", "prefill", decodes=4), load("d1", "decode", decodes=2)
    # 2 rows apart: each token 2 rows sooner for it, 2 fewer on p0's others: 4 ms a token
    assert priced.handover_gain_s(p4, d2, 100) == pytest.approx(100 * 4e-3 - (0.01 + 2e-3))
    assert not priced.keep_local(p4, [d2], 4, expected_tokens=100)
    assert priced.keep_local(p4, [d2], 4, expected_tokens=2)  # a short decode does not pay the gap
    # a prefill instance with prompts queued hands over even to a busier decode instance: its
    # decodes would ride in steps carrying up to 255 prompt tokens (255 ms) each
    busy = load("p0", "prefill", queued=1000, decodes=1)
    assert not priced.keep_local(busy, [load("d1", "decode", decodes=3)], 4, expected_tokens=50)
    # only to a decode instance with room; none: keep
    assert priced.keep_local(busy, [load("d1", "decode", decodes=3, free=3)], 4, expected_tokens=50)
    # where a row costs nothing and no prompt waits, a move saves nothing: keep
    free_rows = Placement(PlacementConfig(step_s=0.04, prefill_token_s=2e-4, decode_row_s=0.0))
    assert free_rows.keep_local(load("p0", "prefill", decodes=6), [load("d1", "decode", decodes=1)], 4, 300)


def test_a_decode_that_would_miss_tpot_beside_recent_prompts_is_handed_over():
    # TPOT limit 2 batch-1 decode steps (tight-tpot): 2 x 11 ms = 22 ms. A prefill instance whose
    # recent steps carried 30 prompt tokens would take 10 + 2 + 30 = 42 ms a token of a decode kept
    # there; the decode instance's 4 decodes and this one, 15 ms: hand over, where the priced
    # rule alone keeps (the decode instance is busier)
    costs = dict(token_budget=256, step_s=0.01, prefill_token_s=1e-3, decode_row_s=1e-3)
    tight = Placement(PlacementConfig(tpot_slo=(0.0, 2.0), **costs))
    untimed = Placement(PlacementConfig(**costs))
    recent = replace(load("p0", "prefill", decodes=1), recent_prompt_tokens=30.0)
    d = load("d1", "decode", decodes=4)
    assert tight.kept_token_s(recent) == pytest.approx(0.042)
    assert untimed.keep_local(recent, [d], 4, expected_tokens=20)
    assert not tight.keep_local(recent, [d], 4, expected_tokens=20)
    # quiet recent steps (5 tokens a step: 17 ms a token) keep it within TPOT: the priced rule decides
    assert tight.keep_local(replace(recent, recent_prompt_tokens=5.0), [d], 4, expected_tokens=20)
    # a decode instance whose own step would pass the limit (12 decodes: 23 ms) is no better: priced rule
    assert tight.keep_local(recent, [load("d1", "decode", decodes=12)], 4, expected_tokens=20)
    # no room there: keep
    assert tight.keep_local(recent, [load("d1", "decode", decodes=4, free=3)], 4, expected_tokens=20)
    # a decode instance with a prompt queued is no refuge (it may be running it whole), nor one whose
    # recent steps carried prompts; and every decode instance with room must qualify (the hand-over
    # picks among them by its own rule)
    assert tight.keep_local(recent, [load("d1", "decode", queued=500, decodes=4)], 4, expected_tokens=20)
    assert tight.keep_local(recent, [replace(d, recent_prompt_tokens=30.0)], 4, expected_tokens=20)
    assert tight.keep_local(recent, [d, load("d2", "decode", queued=500)], 4, expected_tokens=20)
    assert not tight.keep_local(recent, [d, load("d2", "decode", decodes=2)], 4, expected_tokens=20)


def test_rebalance_moves_decodes_until_the_batches_even_out():
    # 10 decodes against 0, each with 100 tokens to go: each move saves 2·(10-0)·1 ms a token less
    # the 10+ ms gap; after 5 the two batches are even and a sixth would only cost
    src, dst = load("d1", "decode", decodes=10), load("p0", "prefill", decodes=0)
    assert PLACE.rebalance_count(src, dst, [(100, 4)] * 10) == 5
    # best first: a decode with one token left does not pay its gap, and stops the moves there
    assert PLACE.rebalance_count(src, dst, [(100, 4), (100, 4), (1, 4), (100, 4)]) == 2
    # no more than the receiver's free blocks
    assert PLACE.rebalance_count(src, load("p0", "prefill", decodes=0, free=9), [(100, 4)] * 10) == 2
    # one apart: nothing to even out
    assert PLACE.rebalance_count(load("d1", "decode", decodes=3), load("d2", "decode", decodes=2), [(500, 4)] * 3) == 0
    # where a row costs nothing a move saves nothing
    free_rows = Placement(PlacementConfig(step_s=0.04, prefill_token_s=2e-4, decode_row_s=0.0))
    assert free_rows.rebalance_count(src, dst, [(500, 4)] * 10) == 0
    # waking an idle instance adds its steps' fixed cost: 3 decodes against none do not pay it,
    # 4 against one busy instance's 1 move one (its steps run anyway)
    assert PLACE.rebalance_count(load("d1", "decode", decodes=3), dst, [(100, 4)] * 3) == 0
    assert PLACE.rebalance_count(load("d1", "decode", decodes=4), load("d2", "decode", decodes=1), [(100, 4)] * 4) == 1
    # a V100-like step (a row 3% of it): ten decodes do not wake an idle instance, thirty do
    v100 = Placement(PlacementConfig(token_budget=1104, step_s=0.038, prefill_token_s=4e-4, decode_row_s=1e-3))
    assert v100.rebalance_count(src, dst, [(200, 4)] * 10) == 0
    assert v100.rebalance_count(load("d1", "decode", decodes=30), dst, [(200, 4)] * 30) > 0


def test_placement_config_names_the_bad_field():
    with pytest.raises(ValueError, match="prefill_token_s"):
        PlacementConfig(prefill_token_s=-1.0)
    with pytest.raises(ValueError, match="placement ranks"):
        load("c0", "coupled")


# ---- the hybrid scheduler ----------------------------------------------------------------------
def cluster_parser():
    """The command line's engine and cluster flags, as every subcommand that builds a cluster takes them."""
    import argparse

    from aserve.commands.common import add_cluster_args, add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_cluster_args(p)
    return p


def req(rid, n, max_tokens=8):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def step(s, plan):
    """Run a plan as a device would: a token for every row that samples."""
    return s.update(plan, StepOutput(sampled={q.request_id: 7 for q in plan.seqs if q.sampling is not None}))


def test_hybrid_chunks_a_prompt_beside_decodes_within_the_budget():
    s = HybridScheduler(BlockManager(200, 16), DecodeConfig(), HybridConfig(token_budget=64))
    for i in range(3):  # three short prompts become three decodes
        s.add_request(req(f"d{i}", 10))
    step(s, s.schedule())
    long = req("long", 150)
    s.add_request(long)
    sizes = []
    while not long.output_token_ids:
        plan = s.schedule()
        assert plan.num_real_tokens <= 64  # never more than the budget
        assert {"d0", "d1", "d2"} <= set(plan.num_scheduled_tokens) or not {"d0", "d1", "d2"} & set(s.running_ids)
        sizes.append(plan.num_scheduled_tokens.get("long", 0))
        events = step(s, plan)
        for r in events.tokens:
            if r.num_output_tokens >= 8:
                s.finish(r, "length")
    assert sizes[:2] == [61, 61] and sum(sizes) == 150  # 64 - 3 decodes, then the rest
    assert "long" in s.running_ids and not s.finished_prefills  # decode role: it stays and decodes here


def test_hybrid_runs_prompts_whole_when_no_decode_rides_in_the_step():
    s = HybridScheduler(BlockManager(200, 16), DecodeConfig(), HybridConfig(token_budget=64))
    s.add_request(req("long", 150))  # longer than the budget: alone and whole (vLLM's prompt step)
    s.add_request(req("a", 30))
    s.add_request(req("b", 30))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"long": 150}
    step(s, plan)
    # now "long" decodes: the prompts behind it are chunked within 64 - 1 beside it
    assert s.schedule().num_scheduled_tokens == {"long": 1, "a": 30, "b": 30}
    chunked = HybridScheduler(BlockManager(200, 16), DecodeConfig(),
                              HybridConfig(token_budget=64, whole_prompts_when_idle=False))
    chunked.add_request(req("long", 150))
    assert chunked.schedule().num_scheduled_tokens == {"long": 64}


def test_prompt_first_runs_a_prompt_that_ends_in_a_step_of_its_own_then_pays_the_budget_back():
    # budget 64, a step's fixed time worth 10 prompt rows; three decodes running
    s = HybridScheduler(BlockManager(200, 16), DecodeConfig(), HybridConfig(token_budget=64, prompt_first_rows=10))
    for i in range(3):
        s.add_request(req(f"d{i}", 10))
    step(s, s.schedule())
    s.add_request(req("a", 20))  # ends within 64 - 3 decodes - 10 = 51 rows: it goes first, alone
    s.add_request(req("b", 40))  # 20 + 40 > 51: it waits for the next step
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 20}
    step(s, plan)
    # the pair of steps stays within one budget: 64 - 4 decodes - (20 + 10) = 30 rows of b's chunk
    assert s.schedule().num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "a": 1, "b": 30}
    assert s.num_prompt_first_steps == 1
    # never two prompt-first steps in a row
    s = HybridScheduler(BlockManager(200, 16), DecodeConfig(), HybridConfig(token_budget=64, prompt_first_rows=10))
    s.add_request(req("d", 10))
    step(s, s.schedule())
    for rid, n in (("a", 20), ("b", 20), ("c", 30)):  # a + b end within 64 - 1 - 10 = 53 rows, c does not
        s.add_request(req(rid, n))
    for want in ({"a": 20, "b": 20}, {"d": 1, "a": 1, "b": 1, "c": 11}, {"c": 19}):
        plan = s.schedule()
        assert plan.num_scheduled_tokens == want
        step(s, plan)
    # a prompt that cannot end within the room shares its step with the decodes, as without the option
    s = HybridScheduler(BlockManager(200, 16), DecodeConfig(), HybridConfig(token_budget=64, prompt_first_rows=10))
    s.add_request(req("d", 10))
    step(s, s.schedule())
    s.add_request(req("long", 60))  # 60 > 64 - 1 - 10
    assert s.schedule().num_scheduled_tokens == {"d": 1, "long": 60}
    with pytest.raises(ValueError, match="prompt_first_rows"):
        HybridConfig(prompt_first_rows=-1)


def test_prompt_first_from_the_command_line_to_the_scheduler():
    from aserve.commands.common import cluster_config
    from aserve.config import EngineConfig
    from aserve.engine.policies import Policies

    p = cluster_parser()
    fixed = ["--chunk-size", "512", "--placement-costs", "0.02,0.0005,0.001"]  # nothing measured: a unit test
    on = cluster_config(p.parse_args(["--mode", "adaptive", "--prompt-first", *fixed]))
    assert on.prompt_first and not cluster_config(p.parse_args(["--mode", "adaptive", *fixed])).prompt_first
    policies = Policies.from_configs(EngineConfig(max_num_batched_tokens=128), on)
    assert policies.prompt_first_rows == round(on.placement_step_s / on.placement_prefill_token_s) > 0


def test_hybrid_admission_leaves_the_watermark_free_while_others_run():
    # 100 blocks of 16, a 10% watermark: 10 blocks stay free for the running requests' next tokens
    s = HybridScheduler(BlockManager(100, 16), DecodeConfig(), HybridConfig(token_budget=2048, watermark=0.1))
    s.add_request(req("first", 95 * 16 - 1))  # nothing runs: it starts even though it eats the watermark
    assert set(s.schedule().num_scheduled_tokens) == {"first"}
    s = HybridScheduler(BlockManager(100, 16), DecodeConfig(), HybridConfig(token_budget=2048, watermark=0.1))
    s.add_request(req("a", 16 * 40 - 1))  # 40 blocks with its first token
    step(s, s.schedule())
    s.add_request(req("fits", 16 * 50 - 1))  # 40 + 50 leaves exactly the 10 blocks
    s.add_request(req("over", 15))  # one block more than the watermark allows: waits
    assert set(s.schedule().num_scheduled_tokens) == {"a", "fits"}
    assert s.blocks.num_free == 10 and [r.request_id for r in s.unstarted()] == ["over"]
    with pytest.raises(ValueError, match="watermark"):
        HybridConfig(watermark=1.0)


def test_unstarted_prompts_can_be_taken_one_by_one():
    # 3 blocks of 16: "a" (40 tokens) starts, the rest wait for blocks and hold none
    s = HybridScheduler(BlockManager(3, 16), DecodeConfig(),
                        HybridConfig(token_budget=16, whole_prompts_when_idle=False))
    for rid, n in (("a", 40), ("b", 30), ("one", 1), ("c", 20)):
        s.add_request(req(rid, n))
    step(s, s.schedule())  # a's first chunk: 16 of its 40 tokens
    assert [r.request_id for r in s.unstarted()] == ["b", "one", "c"]
    assert s.num_queued_tokens == 24 + 30 + 20 and s.num_started_tokens == 24  # a 1-token prompt queues nothing
    assert [r.request_id for r in s.take_unstarted({"one", "c"})] == ["one", "c"]
    assert [r.request_id for r in s.unstarted()] == ["b"] and s.num_requests == 2


def test_prefill_role_hands_over_keeps_or_releases_and_blocks_come_back():
    blocks = BlockManager(100, 16)
    s = HybridScheduler(blocks, DecodeConfig(), HybridConfig(token_budget=512, hand_over=True))
    s.add_request(req("a", 40))
    s.add_request(req("b", 20))
    events = step(s, s.schedule())
    assert {r.request_id for r in events.prefilled} == {"a", "b"}
    assert not s.running_ids and len(s.finished_prefills) == 2
    s.keep("a")  # decodes here
    assert s.running_ids == ["a"]
    s.release("b")  # handed over
    assert s.num_requests == 1
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 1}
    step(s, plan)
    s.abort("a")
    assert blocks.num_free == 100


def test_migrating_decodes_leave_after_their_next_token():
    s = HybridScheduler(BlockManager(100, 16), DecodeConfig(), HybridConfig(token_budget=512))
    s.add_request(req("a", 30))
    step(s, s.schedule())
    s.add_request(req("p", 300))  # admitted next step, mid-prefill when the flip comes
    assert s.mark_migrating() == ["a"]
    events = step(s, s.schedule())
    assert [r.request_id for r in events.prefilled] == ["a"]
    a = events.prefilled[0]
    assert a.num_output_tokens == 2 and a.num_computed_tokens == a.num_tokens - 1  # what accept_incoming expects
    assert s.running_ids == ["p"]


def test_rebalance_marks_only_the_decodes_it_names():
    s = HybridScheduler(BlockManager(100, 16), DecodeConfig(), HybridConfig(token_budget=512))
    for rid in "abc":
        s.add_request(req(rid, 30))
    step(s, s.schedule())
    s.add_request(req("p", 300))  # a prompt: never a running decode
    assert {r.request_id for r in s.running_decodes()} == {"a", "b", "c"}
    assert s.mark_migrating({"b", "p"}) == ["b"]
    assert {r.request_id for r in s.running_decodes()} == {"a", "c"}  # b is already leaving
    events = step(s, s.schedule())
    assert [r.request_id for r in events.prefilled] == ["b"]
    s.keep("b")  # the move did not happen: it decodes here again (and p's prompt ended in that step)
    assert sorted(r.request_id for r in s.running_decodes()) == ["a", "b", "c", "p"]


# ---- flips: hysteresis and dwell ----------------------------------------------------------------
def views(p_busy, d_busy, since_flip=None):
    return [InstanceView("p0", "prefill", "active", p_busy / 2, 0, int(p_busy * 1000), 0),
            InstanceView("p1", "prefill", "active", p_busy / 2, 0, int(p_busy * 1000), 0),
            InstanceView("d2", "decode", "active", 0, d_busy / 2, 0, int(d_busy * 500)),
            InstanceView("d3", "decode", "active", 0, d_busy / 2, 0, int(d_busy * 500), decode_requests=1)]


def test_a_share_inside_the_band_does_not_flip():
    # prefill share 0.65 of the work: past the 2P+2D midpoint (0.625) but not by the band (0.1)
    work = [(t, views(1.3 * t, 0.7 * t)) for t in range(0, 30)]
    assert [d for t, v in work if (d := RatioFlipPolicy(window_s=4.0, band=0.1).decide(t, v))] == []
    no_band = RatioFlipPolicy(window_s=4.0, band=0.0)
    assert any(no_band.decide(t, v) for t, v in work)
    # far past it (0.9): flips
    busy = RatioFlipPolicy(window_s=4.0, band=0.1)
    assert any(busy.decide(t, views(1.8 * t, 0.2 * t)) for t in range(0, 30))


def test_an_instance_keeps_its_role_for_its_dwell():
    clock = FakeClock()
    pol = RatioFlipPolicy(window_s=4.0, cooldown_s=0.0, band=0.0, dwell_s=30.0)
    decisions = []
    for t in range(0, 60):
        clock.advance(1.0) if t else None
        d = pol.decide(clock.now(), views(1.8 * t, 0.2 * t))
        if d is not None:
            decisions.append((clock.now(), d.instance_id))
            pol.note_flip(clock.now(), d.instance_id)
    assert decisions and decisions[0][1] == "d2"
    # nobody moved before its first dwell was over, and no instance moved twice within its dwell
    assert decisions[0][0] >= 30.0
    flips_of = {}
    for t, iid in decisions:
        if iid in flips_of:
            assert t - flips_of[iid] >= 30.0
        flips_of[iid] = t


def test_flip_band_is_checked():
    with pytest.raises(ValueError, match="band"):
        RatioFlipPolicy(band=0.7)


def test_keep_margin_from_the_command_line_to_the_placement():
    from aserve.cluster.cluster import Cluster
    from aserve.commands.common import cluster_config
    from aserve.config import ClusterConfig, EngineConfig

    p = cluster_parser()
    cfg = cluster_config(p.parse_args(["--mode", "adaptive", "--keep-margin", "1"]))
    assert cfg.keep_margin == 1 and Cluster(EngineConfig(), cfg).placement.config.keep_margin == 1
    for args in ([], ["--keep-margin", "auto"]):  # priced by default
        assert cluster_config(p.parse_args(["--mode", "adaptive", *args])).keep_margin is None
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(SystemExit):
            p.parse_args(["--mode", "adaptive", "--keep-margin", bad])
    with pytest.raises(ValueError, match="keep_margin must be >= 0, got -1"):
        ClusterConfig(keep_margin=-1)


def test_rebalance_from_the_command_line():
    from aserve.commands.common import cluster_config
    from aserve.config import ClusterConfig

    p = cluster_parser()
    cfg = cluster_config(p.parse_args(["--mode", "adaptive"]))
    assert cfg.rebalance and cfg.rebalance_quiet_s == 10.0  # on by default, after 10 quiet seconds
    cfg = cluster_config(p.parse_args(["--mode", "adaptive", "--no-rebalance", "--rebalance-quiet", "2.5"]))
    assert not cfg.rebalance and cfg.rebalance_quiet_s == 2.5
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "adaptive", "--rebalance-quiet", "soon"])
    with pytest.raises(ValueError, match="rebalance_quiet_s must be >= 0, got -1"):
        ClusterConfig(rebalance_quiet_s=-1)


def test_placement_costs_pinned_from_the_command_line_reach_the_placement():
    """``--placement-costs`` replays a real run's placement prices (its report's config) on sim:,
    where they would otherwise come from the sim profile; nothing is measured when they are given."""
    from aserve.cluster.cluster import Cluster
    from aserve.commands.common import cluster_config
    from aserve.config import EngineConfig

    p = cluster_parser()
    cfg = cluster_config(p.parse_args(["--mode", "adaptive", "--chunk-size", "128",
                                       "--placement-costs", "0.0625,0.003,0.0256"]))
    assert (cfg.placement_step_s, cfg.placement_prefill_token_s, cfg.placement_decode_row_s) == (0.0625, 0.003, 0.0256)
    placed = Cluster(EngineConfig(), cfg).placement.config
    assert (placed.step_s, placed.prefill_token_s, placed.decode_row_s) == (0.0625, 0.003, 0.0256)
    for bad in ("0.1,0.2", "a,b,c", "0.1,-0.2,0.3", "0.1,0.2,0.3,0.4", "nan,0,0", "0,inf,0"):
        with pytest.raises(SystemExit):
            p.parse_args(["--mode", "adaptive", "--placement-costs", bad])


def test_kv_relief_is_on_by_default_and_off_by_name():
    """``--kv-relief``: 16 blocks unless given; ``off`` gives None (preempt instead); anything else
    but a whole number >= 0 is refused with the flag named."""
    from aserve.commands.common import cluster_config
    from aserve.config import ClusterConfig

    p = cluster_parser()
    assert ClusterConfig().kv_relief == 16
    assert cluster_config(p.parse_args(["--mode", "adaptive"])).kv_relief == 16
    assert cluster_config(p.parse_args(["--mode", "adaptive", "--kv-relief", "off"])).kv_relief is None
    assert cluster_config(p.parse_args(["--mode", "adaptive", "--kv-relief", "0"])).kv_relief == 0
    for bad in ("-1", "lots", "1.5", ""):
        with pytest.raises(SystemExit):
            p.parse_args(["--mode", "adaptive", "--kv-relief", bad])


def test_a_head_without_blocks_does_not_hold_an_idle_instance_for_ever():
    # A preempted request at the head of the queue needs more blocks than are free, and the only
    # blocks held are those of a hand-over that landed behind it: with nothing running, nothing
    # would ever free them. Seen at paper scale (AzureCode, tight TPOT), where a goodput search's
    # replay spun on virtual time for ever. The hand-over runs first, then the head.
    s = HybridScheduler(BlockManager(20, 16), DecodeConfig(), HybridConfig(token_budget=256))
    big = req("big", 200, max_tokens=50)
    s.add_request(big)
    step(s, s.schedule())  # its prompt, whole: 201 tokens in 13 blocks
    held = Request("held", list(range(1, 101)), SamplingParams(max_tokens=4, temperature=0))
    held.output_token_ids, held.num_computed_tokens = [7], 100  # prefilled elsewhere, its KV on the way
    assert s.allocate_incoming(held) is not None and s.blocks.num_free == 0  # 7 blocks reserved
    while "big" in s.running_ids:  # big grows into a 14th block, finds none, and is preempted
        step(s, s.schedule())
    assert big.num_preemptions == 1 and s.blocks.num_free == 13
    s.accept_incoming(held)  # lands behind big, which needs 14 blocks for prompt + output
    assert s.waiting_ids == ["big", "held"]
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"held": 1}
    for _ in range(200):  # both finish: held frees its blocks, then big starts again
        events = step(s, plan)
        for r in events.tokens:
            if r.num_output_tokens >= r.sampling.max_tokens:
                s.finish(r, "length")
        if not s.num_requests:
            break
        plan = s.schedule()
        assert not plan.empty, "an instance with requests and nothing running made no plan"
    assert not s.num_requests and held.finish_reason == big.finish_reason == "length"
