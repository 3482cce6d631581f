"""ALISE pieces one at a time: latency model, stall accounting, ranking, aging, demotion,
preemption and the expected-wait rule for the KV of preempted jobs."""
from __future__ import annotations

import math

import pytest

from scheduling import registry
from scheduling.alise import AliseConfig, AliseScheduler
from scheduling.block_manager import BlockManager
from scheduling.clock import FakeClock
from scheduling.coupled import BatchingConfig
from scheduling.latency_model import LatencyModel, fit
from scheduling.request import LengthRange, Request, SamplingParams, Status
from scheduling.stalls import count_stalls
from scheduling.step import StepOutput
from tests.test_batching_invariants import Workload, assert_all_done, drive

SLOW = LatencyModel(t0=0.01, alpha=0.0, beta=1.0)  # one second a decode step: levels by tokens


def make(num_blocks=64, max_seqs=1, budget=64, host=64, latency=LatencyModel(), **config):
    clock = FakeClock()
    sched = AliseScheduler(BlockManager(num_blocks, 4), BatchingConfig(budget, max_seqs), clock,
                           latency=latency, alise=AliseConfig(**config),
                           host_blocks=BlockManager(host, 4) if host else None)
    return sched, clock


def req(rid, prompt=4, max_tokens=16, predicted=None):
    return Request(rid, list(range(2, 2 + prompt)), SamplingParams(max_tokens=max_tokens), predicted=predicted)


def step(sched, clock, dt=0.04):
    """One engine step with the fake model (token 1 whenever a request catches up)."""
    out = sched.schedule()
    sampled = {rid: 1 for rid, n in out.num_scheduled_tokens.items()
               if sched.requests[rid].num_computed_tokens + n == sched.requests[rid].num_tokens}
    sched.update(out, StepOutput(sampled))
    clock.advance(dt)
    return out


# ---- latency model ------------------------------------------------------------------------
def test_fit_recovers_coefficients():
    t0, alpha, beta = 0.002, 1e-4, 0.02
    prefill = [(s, s * t0) for s in (16, 64, 256)]
    decode = [(s, n, n * (alpha * s + beta)) for s in (10, 100, 1000) for n in (1, 8)]
    m = fit(prefill, decode)
    assert m.t0 == pytest.approx(t0) and m.alpha == pytest.approx(alpha) and m.beta == pytest.approx(beta)


def test_fit_degenerate_profiles_fall_back_to_flat_decode():
    one_context = LatencyModel().fit(decode_points=[(50, 4, 0.2), (50, 2, 0.1)])
    assert one_context.alpha == 0 and one_context.beta == pytest.approx(0.05)
    falling = LatencyModel().fit(decode_points=[(10, 1, 0.5), (1000, 1, 0.1)])  # noise, not physics
    assert falling.alpha == 0 and falling.beta == pytest.approx(0.3)
    assert LatencyModel(t0=0.5).fit(decode_points=[(1, 1, 1.0)]).t0 == 0.5  # no prefill points


def test_estimate_remaining_uses_the_safe_bound():
    m = LatencyModel(t0=0.01, alpha=0.001, beta=0.1)
    r = req("a", prompt=10, max_tokens=50)
    assert m.estimate_remaining(r) == pytest.approx(10 * 0.01 + 49 * (0.001 * (10 + 48 / 2) + 0.1))
    r.predicted = LengthRange(5, 20)  # at most 19 tokens: the prefill makes one, 18 steps left
    assert m.estimate_remaining(r) == pytest.approx(0.1 + 18 * (0.001 * (10 + 17 / 2) + 0.1))
    assert m.estimate_remaining(r, max_output=40) > m.estimate_remaining(r)
    r.output_token_ids, r.num_computed_tokens = [1] * 5, 14  # decoding: 14 steps left, no prefill
    assert m.estimate_remaining(r) == pytest.approx(14 * (0.001 * (15 + 13 / 2) + 0.1))
    r.output_token_ids, r.num_computed_tokens = [1] * 25, 34  # outgrew the bound: nothing left
    assert m.estimate_remaining(r) == 0.0
    with pytest.raises(ValueError):
        LatencyModel(beta=-1.0)


# ---- stalls -------------------------------------------------------------------------------
def test_count_stalls():
    times = {"a": [0, 1, 2, 3, 13, 14], "b": [5, 6, 7], "c": [9]}
    s = count_stalls(times)
    assert (s.count, s.total_s, s.longest_s, s.median_tbt_s, s.num_gaps) == (1, 10, 10, 1, 7)
    assert count_stalls(times, k=20).count == 0
    assert count_stalls(list(times.values()), k=5, median_tbt_s=0.1).count == 7
    assert count_stalls([[1.0]]).count == 0 and count_stalls({}).fraction == 0.0


# ---- ranking, aging, demotion ---------------------------------------------------------------
def test_levels_and_config_checks():
    cfg = AliseConfig(level_base_s=1.0, level_ratio=4.0, num_levels=4)
    assert [cfg.level_of(t) for t in (0, 0.99, 1.0, 3.9, 4.0, 16.0, 1e9)] == [0, 0, 1, 1, 2, 3, 3]
    assert cfg.aging_bound_s(step_s=0.1, max_jobs=10) == pytest.approx(4 * cfg.aging_s + 1.0)
    for bad in (dict(num_levels=0), dict(level_ratio=1.0), dict(aging_s=0), dict(swap_after_s=-1)):
        with pytest.raises(ValueError):
            AliseConfig(**bad)


def test_waiting_promotes_one_level_per_aging_period_then_starves():
    sched, clock = make(latency=SLOW, aging_s=1.0)
    sched.add_request(req("a", max_tokens=20))  # about 19 s left: the lowest level
    levels = []
    for _ in range(6):
        levels.append(sched.level("a"))
        clock.advance(1.0)
    assert levels == [3, 2, 1, 0, -1, -1]


def test_outgrown_prediction_is_doubled_and_demoted():
    sched, clock = make(latency=SLOW)
    sched.add_request(req("a", max_tokens=24, predicted=LengthRange(0, 5)))  # bound: 4 tokens
    seen = {}
    while sched.requests["a"].num_output_tokens < 20:
        step(sched, clock)
        r = sched.requests["a"]
        seen[r.num_output_tokens] = (sched.predicted_output("a"), sched.level("a"))
    assert [seen[n][0] for n in (4, 5, 8, 9, 16, 17, 20)] == [4, 8, 8, 16, 16, 24, 24]  # capped
    assert sched.num_demotions == 3
    assert seen[5][1] > seen[4][1]  # demoted the moment it outgrew


def test_higher_priority_arrival_preempts_and_kv_is_kept():
    sched, clock = make(latency=SLOW, swap_after_s=5.0)
    sched.add_request(req("long", max_tokens=30))
    for _ in range(3):
        step(sched, clock)
    long = sched.requests["long"]
    blocks, computed = list(long.block_ids), long.num_computed_tokens
    sched.add_request(req("short", max_tokens=2))
    out = step(sched, clock)
    assert list(out.num_scheduled_tokens) == ["short"] and out.preempted_ids == ("long",)
    assert [(d.request_id, d.action) for d in out.kv_decisions] == [("long", "keep")]
    assert long.status is Status.PREEMPTED and long.block_ids == blocks and long.num_computed_tokens == computed
    while "short" in sched.requests:
        if sched.requests["short"].num_output_tokens == 2:
            sched.finish(sched.requests["short"], "length")
            continue
        step(sched, clock)
    out = step(sched, clock)
    assert out.num_scheduled_tokens == {"long": 1} and not out.swap_in  # resumed from its own blocks


def _preempt_long_for(sched, clock, short_tokens):
    sched.add_request(req("long", prompt=8, max_tokens=30))
    for _ in range(3):
        step(sched, clock)
    long = sched.requests["long"]
    blocks, computed = list(long.block_ids), long.num_computed_tokens
    sched.add_request(req("b", max_tokens=short_tokens))
    return step(sched, clock), long, blocks, computed


def test_long_expected_wait_swaps_out_then_prefetches_back():
    sched, clock = make(latency=SLOW, swap_after_s=4.0)
    out, long, blocks, computed = _preempt_long_for(sched, clock, short_tokens=10)  # EWT ~10 s
    (d,) = out.kv_decisions
    assert (d.request_id, d.action) == ("long", "swap_out") and d.ewt_s >= 4.0
    host_ids = [h for _, h in out.swap_out]
    assert [dev for dev, _ in out.swap_out] == blocks and sched.host.num_used == len(blocks)
    assert long.block_ids == [] and long.num_computed_tokens == computed  # KV kept on host
    prefetched = None
    while prefetched is None:
        out = step(sched, clock)
        prefetched = next((d for d in out.kv_decisions if d.action == "swap_in"), None)
    assert "long" not in out.num_scheduled_tokens and prefetched.ewt_s < 2.0  # back early, hysteresis
    assert [h for h, _ in out.swap_in] == host_ids and sched.host.num_used == 0
    assert [dev for _, dev in out.swap_in] == long.block_ids


def test_long_wait_with_full_host_keeps_kv_on_device():
    sched, clock = make(latency=SLOW, swap_after_s=4.0, host=1)
    out, long, blocks, _ = _preempt_long_for(sched, clock, short_tokens=10)
    (d,) = out.kv_decisions
    assert d.action == "keep" and d.ewt_s >= 4.0 and long.block_ids == blocks and not out.swap_out


def test_short_expected_wait_keeps_kv():
    sched, clock = make(latency=SLOW, swap_after_s=4.0)
    out, long, blocks, _ = _preempt_long_for(sched, clock, short_tokens=2)  # EWT ~2 s
    (d,) = out.kv_decisions
    assert d.action == "keep" and d.ewt_s < 4.0 and long.block_ids == blocks


@pytest.mark.parametrize("host", [64, 0])
def test_better_job_needing_blocks_evicts_the_worst_holder(host):
    """Blocks, not seats, run out: the holder's KV goes to host, or is dropped without one."""
    sched, clock = make(num_blocks=12, max_seqs=2, latency=SLOW, host=host, swap_after_s=100.0)
    sched.add_request(req("long", prompt=24, max_tokens=16))  # 7 blocks once decoding
    step(sched, clock)
    step(sched, clock)
    sched.add_request(req("b", prompt=28, max_tokens=2))  # 7 blocks for its prompt: only 5 are free
    out = step(sched, clock)
    assert "b" in out.num_scheduled_tokens and "long" in out.preempted_ids
    (d,) = [d for d in out.kv_decisions if d.request_id == "long"]
    assert d.ewt_s is None and d.action == ("swap_out" if host else "recompute")
    assert sched.requests["long"].num_computed_tokens == (25 if host else 0)


# ---- starvation ---------------------------------------------------------------------------
def _stream(n_short: int) -> Workload:
    """One long job against short ones arriving exactly as fast as one seat serves them."""
    reqs = [req("long", max_tokens=100)] + [req(f"s{i}", max_tokens=5) for i in range(n_short)]
    targets = {r.request_id: r.sampling.max_tokens for r in reqs}
    arrive = {r.request_id: 0 if r.request_id == "long" else 5 * int(r.request_id[1:]) for r in reqs}
    return Workload(reqs, targets, arrive)


@pytest.mark.parametrize("aging_s", [0.5, math.inf])
def test_aging_bounds_every_wait(aging_s):
    sched, clock = make(aging_s=aging_s)
    work = _stream(40)
    run = drive(sched, work, clock, dt=0.04)
    assert_all_done(sched, work)
    bound = sched.alise.aging_bound_s(0.04, run.max_in_system)
    if math.isinf(aging_s):  # without aging the long job waits out the whole stream
        assert run.waits["long"] > 40 * 5 * 0.04 - 0.1
    else:
        assert max(run.waits.values()) <= bound < 40 * 5 * 0.04 - 0.1


def test_batching_registry_and_admission_checks():
    blocks = BlockManager(8, 4)
    assert type(registry.get("batching", "sarathi")(blocks)).__name__ == "SarathiScheduler"
    assert registry.names("batching") == ("sarathi", "vllm", "alise")
    with pytest.raises(ValueError, match="sarathi, vllm, alise"):
        registry.get("batching", "fifo")
    sched = registry.get("batching", "alise")(blocks, clock=FakeClock())
    with pytest.raises(ValueError):  # 8 blocks hold 32 tokens; 4 + 40 may not fit
        sched.add_request(req("big", max_tokens=40))
