"""Flip policies on made-up views (no engine), and the decode scheduler's failure hooks:
adopting a request whose KV was lost, and reclaiming reservations whose KV never came."""
import pytest

from scheduling.block_manager import BlockManager
from scheduling.clock import FakeClock
from scheduling.decode import DecodeScheduler
from scheduling.step import StepOutput
from scheduling import registry
from scheduling.flip import IdleFlipPolicy, InstanceView, RatioFlipPolicy, other_role
from scheduling.request import Request, SamplingParams


def view(iid, role, pb=0.0, db=0.0, pt=0, dt=0, queued=0, reqs=0, waiting=0, state="active"):
    return InstanceView(iid, role, state, pb, db, pt, dt, queued, reqs, waiting)


def cluster_at(p_busy, d_busy, **kw):
    """2 prefill + 2 decode instances with these cumulative busy seconds per role."""
    return [view("p0", "prefill", pb=p_busy / 2, pt=int(p_busy * 1000), **kw.get("p", {})),
            view("p1", "prefill", pb=p_busy / 2, pt=int(p_busy * 1000)),
            view("d2", "decode", db=d_busy / 2, dt=int(d_busy * 500), reqs=kw.get("reqs", 0)),
            view("d3", "decode", db=d_busy / 2, dt=int(d_busy * 500), reqs=kw.get("reqs", 0) + 1)]


def run(policy, samples):
    """Feed (time, views) samples; return the decisions in order."""
    out = []
    for t, views in samples:
        d = policy.decide(t, views)
        if d is not None:
            out.append((t, d))
    return out


def test_ratio_moves_a_prefill_instance_to_decode_when_decode_work_dominates():
    pol = RatioFlipPolicy(window_s=4.0)
    # decode instances busy all the time (2 s of work per second), prefill nearly idle
    samples = [(t, cluster_at(0.05 * t, 2.0 * t)) for t in range(0, 8)]
    decisions = run(pol, samples)
    assert decisions, "no flip"
    t, d = decisions[0]
    assert d.to_role == "decode" and d.instance_id in ("p0", "p1")
    assert t >= 4.0  # waits for a whole window of history
    assert pol.last_work[1] > pol.last_work[0]


def test_ratio_moves_a_decode_instance_to_prefill_when_prefill_work_dominates():
    pol = RatioFlipPolicy(window_s=4.0)
    decisions = run(pol, [(t, cluster_at(2.0 * t, 0.1 * t, reqs=0)) for t in range(0, 8)])
    assert decisions[0][1].to_role == "prefill"
    assert decisions[0][1].instance_id == "d2"  # the least loaded decode instance


def test_ratio_keeps_a_balanced_cluster_and_an_idle_one_as_they_are():
    assert run(RatioFlipPolicy(window_s=4.0), [(t, cluster_at(1.5 * t, 1.5 * t)) for t in range(12)]) == []
    assert run(RatioFlipPolicy(window_s=4.0), [(t, cluster_at(0.01 * t, 0.02 * t)) for t in range(12)]) == []


def test_ratio_cooldown_and_last_instance_rule():
    pol = RatioFlipPolicy(window_s=4.0, cooldown_s=100.0)
    samples = [(t, cluster_at(0.0, 2.0 * t)) for t in range(0, 30)]
    decisions = run(pol, samples)
    assert len(decisions) >= 1
    pol2 = RatioFlipPolicy(window_s=4.0, cooldown_s=100.0)
    first = run(pol2, samples[:5])
    assert first
    pol2.note_flip(5.0)
    assert run(pol2, samples[5:30]) == []  # cooldown
    # one prefill and one decode left: never flips the last of a role
    two = [(t, [view("p0", "prefill", pb=0.0), view("d1", "decode", db=2.0 * t, dt=1000 * t)]) for t in range(20)]
    pol3 = RatioFlipPolicy(window_s=4.0)
    assert all(d.instance_id != "p0" for _, d in run(pol3, two))


def test_ratio_counts_backlog_as_work():
    """Queued prompt tokens are prefill work even before anyone computes them."""
    pol = RatioFlipPolicy(window_s=4.0, prefill_s_per_token=1e-3)
    samples = [(t, [view("p0", "prefill", queued=20000), view("p1", "prefill", queued=20000),
                    view("d2", "decode", db=0.1 * t, dt=100 * t), view("d3", "decode", db=0.1 * t, dt=100 * t)])
               for t in range(8)]
    decisions = run(pol, samples)
    assert decisions and decisions[0][1].to_role == "prefill"


def test_ratio_waits_while_an_instance_drains():
    pol = RatioFlipPolicy(window_s=4.0)
    samples = [(t, cluster_at(0.0, 2.0 * t)[:3] + [view("d3", "decode", state="draining")]) for t in range(10)]
    assert run(pol, samples) == []


def test_idle_policy_flips_after_the_idle_window_towards_waiting_work():
    pol = IdleFlipPolicy(idle_s=60.0)
    busy_decode = [view("p0", "prefill"), view("p1", "prefill", queued=10), view("d2", "decode", reqs=5)]
    decisions = run(pol, [(t, busy_decode) for t in range(0, 121, 10)])
    assert decisions[0][0] == 60 and decisions[0][1].instance_id == "p0" and decisions[0][1].to_role == "decode"
    # no waiting work on the other side: stays
    quiet = [view("p0", "prefill"), view("p1", "prefill"), view("d2", "decode")]
    assert run(IdleFlipPolicy(idle_s=60.0), [(t, quiet) for t in range(0, 300, 10)]) == []
    # load resets the idle clock
    pol = IdleFlipPolicy(idle_s=60.0)
    wave = [(t, [view("p0", "prefill", queued=5 if t == 50 else 0), view("p1", "prefill"),
                 view("d2", "decode", reqs=3)]) for t in range(0, 200, 10)]
    firsts = first_flips(run(pol, wave))
    # p1 has been idle since 0; p0's load at 50 restarted its idle clock (50 + 60 = 110)
    assert firsts == {"p1": 60, "p0": 110}


def first_flips(decisions):
    """Each instance's first flip time (the views never change, so a policy decides again later)."""
    firsts = {}
    for t, d in decisions:
        firsts.setdefault(d.instance_id, t)
    return firsts


def test_policy_names_and_errors():
    assert registry.get("flip", "off")().decide(0.0, []) is None
    assert isinstance(registry.get("flip", "ratio")(window_s=3), RatioFlipPolicy)
    assert registry.names("flip") == ("off", "idle", "ratio")
    with pytest.raises(ValueError, match="unknown flip policy 'sideways'"):
        registry.get("flip", "sideways")
    with pytest.raises(ValueError):
        RatioFlipPolicy(window_s=0)
    with pytest.raises(ValueError):
        other_role("coupled")


# ---- decode scheduler: adopt and lease --------------------------------------------------------
def _req(rid, prompt=20, out=3):
    r = Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=50, temperature=0))
    r.output_token_ids = list(range(100, 100 + out))
    return r


def test_adopted_request_recomputes_prompt_and_output_in_one_step():
    sched = DecodeScheduler(BlockManager(64, 16), clock=FakeClock())
    r = _req("a", prompt=20, out=3)
    sched.add_request(r)
    s = sched.schedule()
    assert s.num_scheduled_tokens["a"] == 23 and s.seqs[0].start_pos == 0
    sched.update(s, StepOutput({"a": 7}))
    assert r.output_token_ids[-1] == 7 and r.num_computed_tokens == 23
    s = sched.schedule()
    assert s.num_scheduled_tokens["a"] == 1
    (got,) = sched.update(s, StepOutput({"a": 8})).tokens
    sched.finish(got, "stop")
    assert sched.blocks.num_free == 64 and got.finish_reason == "stop"


def test_lease_reclaims_reservations_whose_kv_never_came():
    clock = FakeClock()
    sched = DecodeScheduler(BlockManager(64, 16), clock=clock)
    lost, moving = _req("lost", out=1), _req("moving", out=1)
    for r in (lost, moving):
        r.num_computed_tokens = r.num_prompt_tokens
        assert sched.allocate_incoming(r) is not None
    assert sched.blocks.num_free == 60  # 20 prompt tokens: two 16-token blocks each
    clock.advance(30.0)
    assert sched.reclaim_incoming(60.0) == []
    clock.advance(31.0)
    assert sched.reclaim_incoming(60.0, keep=["moving"]) == ["lost"]
    assert sched.blocks.num_free == 62 and sched.incoming_ids == ["moving"]


def test_draining_prefill_hands_over_only_untouched_requests():
    from scheduling.prefill import PrefillConfig, PrefillScheduler

    sched = PrefillScheduler(BlockManager(64, 16), PrefillConfig(chunk_size=32, sched_batch=4), FakeClock())
    a, b, c = (Request(r, list(range(1, 41)), SamplingParams(max_tokens=8)) for r in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    plan = sched.schedule()  # 32 tokens of a
    assert [s.request_id for s in plan.seqs] == ["a"]
    taken = sched.take_unstarted()
    assert [r.request_id for r in taken] == ["b", "c"] and all(not r.block_ids for r in taken)
    sched.update(plan, StepOutput({}))
    plan = sched.schedule()
    assert [s.request_id for s in plan.seqs] == ["a"] and not sched.take_unstarted()
    assert sched.update(plan, StepOutput({"a": 5})).prefilled == (a,)
