"""The simulated device: virtual time, hand-computed replays, determinism, the shipped V100 profile."""
from __future__ import annotations

import asyncio
import json
import time
from datetime import date

import pytest

from aserve.profiles.cost_model import CostModel
from aserve.devices.sim_device import load_profile
from aserve.devices.virtual_time import VirtualClock, run_virtual

# 10 ms a step plus 1 ms a row (1 row: 11 ms, 20 rows: 30 ms); attention free: easy to add up by hand
FLAT = CostModel(tokens=(1, 1001), linear_s=(0.011, 1.011), attn_prefill_s=0.0, attn_decode_s=0.0)


def test_virtual_time_runs_an_hour_in_an_instant():
    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(3600)
        done = await asyncio.wait_for(asyncio.sleep(5, result="late"), timeout=10)
        return loop.time() - t0, done

    clock = VirtualClock()
    wall = time.perf_counter()
    elapsed, done = run_virtual(main(), clock)
    assert elapsed == pytest.approx(3605) and clock.now() == pytest.approx(3605) and done == "late"
    assert time.perf_counter() - wall < 1.0


def replay_sim(tmp_path, trace: list[dict], *flags: str, name: str = "out", cost: CostModel = FLAT) -> dict:
    from aserve.commands import main

    (tmp_path / "flat.json").write_text(json.dumps(cost.to_json()))
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in trace))
    out = tmp_path / f"{name}.json"
    assert main(["replay", str(path), "--device", f"sim:{tmp_path / 'flat.json'}", "--no-warmup", "--no-progress",
                 "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


def replay_two(tmp_path, cost: CostModel = FLAT) -> dict:
    """One coupled instance, sarathi, budget 64: request a (20 + 3 tokens) at 0, b (8 + 2) at 0.035."""
    report = replay_sim(tmp_path, [{"timestamp": 0.0, "prompt_tokens": 20, "output_tokens": 3},
                                   {"timestamp": 0.035, "prompt_tokens": 8, "output_tokens": 2}],
                        "--mode", "coupled", "--instances", "1", "--batching", "sarathi",
                        "--max-num-batched-tokens", "64", "--predictor", "none", cost=cost)
    (s,) = report["systems"].values()
    assert s["completed"] == 2 and s["output_tokens"] == 5
    return s


def assert_two(s: dict, b_first: float, a_done: float, b_done: float, steps: tuple) -> None:
    """``replay_two``'s figures: a's first token at 0.030 (its prompt step), b's at ``b_first``, a
    and b done at ``a_done`` and ``b_done``, the steps' seconds adding up to the busy time."""
    assert s["ttft"]["mean"] == pytest.approx(((0.030 - 0) + (b_first - 0.035)) / 2)
    assert s["jct"]["mean"] == pytest.approx(((a_done - 0) + (b_done - 0.035)) / 2)
    assert s["resource_usage_s"] == pytest.approx(sum(steps))


def test_a_small_replay_matches_hand_computed_step_times(tmp_path):
    """``replay_two``'s steps: [a:20] 30 ms -> a's first token at 0.030; [a:1] 11 ms -> 0.041 (b
    arrived at 0.035 and joins the next step); [a:1, b:8] 19 ms -> a done at 0.060, b's first
    token 0.060; [b:1] 11 ms -> b done at 0.071."""
    assert_two(replay_two(tmp_path), 0.060, 0.060, 0.071, (0.030, 0.011, 0.019, 0.011))


def test_a_speed_trace_slows_the_steps_that_start_in_its_window(tmp_path):
    """The replay above on a profile whose speed trace doubles every cost from 35 ms after the
    first step: [a:20] 30 ms and [a:1] 11 ms as before (they start at 0 and 0.030); [a:1, b:8]
    starts at 0.041, in the slow window: 38 ms -> a done and b's first token at 0.079; [b:1]
    22 ms -> b done at 0.101. Without a trace the file has no such key (profiles as before)."""
    from dataclasses import replace

    assert "speed_trace" not in FLAT.to_json()
    traced = replace(FLAT, speed_trace=((0.0, 1.0), (0.035, 2.0)))
    assert CostModel.from_json(json.loads(json.dumps(traced.to_json()))) == traced
    assert [traced.speed_at(t) for t in (-1, 0, 0.0349, 0.035, 100)] == [1.0, 1.0, 1.0, 2.0, 2.0]
    for bad in (((1.0, 1.0), (0.5, 1.0)), ((0.0, 1.0), (0.0, 2.0)), ((0.0, 0.0),)):
        with pytest.raises(ValueError, match="speed trace"):
            replace(FLAT, speed_trace=bad)
    assert_two(replay_two(tmp_path, traced), 0.079, 0.079, 0.101, (0.030, 0.011, 0.038, 0.022))


def test_disaggregated_sim_replay_is_deterministic_and_charges_the_link(tmp_path):
    trace = [{"timestamp": 0.05 * i, "prompt_tokens": 30 + 7 * i, "output_tokens": 3 + i % 4} for i in range(12)]
    flags = ("--mode", "disagg", "--prefill", "1", "--decode", "2", "--chunk-size", "64", "--link", "roce",
             "--emulate-model", "opt-13b", "--predictor", "none")
    a = replay_sim(tmp_path, trace, *flags, name="a")["systems"]
    b = replay_sim(tmp_path, trace, *flags, name="b")["systems"]
    host = {"wall_s", "simulated_s_per_wall_s"}  # how long the host took: the one thing that differs
    (s,), (t,) = a.values(), b.values()
    assert {k: v for k, v in s.items() if k not in host} == {k: v for k, v in t.items() if k not in host}
    assert s["completed"] == 12 and s["kv_bytes_moved"] == 0  # no bytes move in a simulation
    # ... but the link is charged OPT-13B's KV (819,200 B a token) for every prompt handed over
    assert s["kv_bytes_charged"] >= 819_200 * sum(r["prompt_tokens"] for r in trace)
    assert s["kv_bytes_charged"] % 819_200 == 0
    assert s["simulated_s_per_wall_s"] > 1


def test_the_v100_profile_meets_the_papers_anchors():
    """TetriInfer Fig. 2: prefill saturates near 512 tokens; a light decode step beside a heavy
    prefill is several times slower (§2.2: ~5x)."""
    prof = load_profile("opt-13b-v100-32gb")
    cost = prof.cost
    assert 384 <= cost.saturate_chunk(tile=64, max_chunk=2048) <= 768
    slowdown = cost.step_s([(1024, 0)], [128] * 32) / cost.decode_s(32, 128)
    assert 4 < slowdown < 12
    assert prof.model_args().kv_bytes_per_token == 819_200
    tokens = prof.kv_capacity_bytes // 819_200
    assert 4000 < tokens < 7000  # a V100's 32 GB less OPT-13B's 25.7 GB of weights


def test_set_accuracy_predictor(tmp_path):
    from predictors.simple import SetAccuracyPredictor, error_offsets
    from scheduling.request import Request, SamplingParams

    confusion = tmp_path / "c.json"
    confusion.write_text(json.dumps({"confusion": [[8, 2, 0], [1, 6, 3], [0, 0, 5]]}))
    assert error_offsets(json.loads(confusion.read_text())["confusion"]) == {-1: 1 / 6, 1: 5 / 6}
    reqs = []
    for i in range(2000):
        r = Request(f"r{i}", [1, 2], SamplingParams(max_tokens=2048))
        r.oracle_length = 450  # bucket 2 at g=200
        reqs.append(r)
    for acc in (1.0, 0.749, 0.0):
        p = SetAccuracyPredictor(granularity=200, accuracy=acc, confusion=str(confusion), seed=3)
        got = [x.bucket for x in p.predict(reqs)]
        share = sum(b == 2 for b in got) / len(got)
        assert abs(share - acc) < 0.03, (acc, share)
        assert set(got) <= {1, 2, 3} and got == [x.bucket for x in p.predict(reqs)]  # deterministic
    with pytest.raises(ValueError, match="accuracy must be in"):
        SetAccuracyPredictor(accuracy=1.5, confusion=str(confusion))


def test_adaptive_sim_replay_prefills_on_both_roles_and_returns_every_block(tmp_path):
    """A burst of heavy prompts on 1P+1D adaptive: the prefill queue grows, so the decode instance
    prefills some of them itself (its KV never moves); every request ends and both pools are
    whole again."""
    trace = [{"timestamp": 0.01 * i, "prompt_tokens": 300 + 20 * i, "output_tokens": 4 + i % 5} for i in range(16)]
    report = replay_sim(tmp_path, trace, "--mode", "adaptive", "--prefill", "1", "--decode", "1",
                        "--max-num-batched-tokens", "256", "--predictor", "none")
    (s,) = report["systems"].values()
    assert s["completed"] == 16 and s["output_tokens"] == sum(r["output_tokens"] for r in trace)
    by_role = {i["role"]: i for i in s["instances"]}
    assert by_role["decode"]["prefill_tokens"] > 0 and by_role["prefill"]["prefill_tokens"] > 0
    for inst in s["instances"]:
        assert inst["free_blocks_end"] == inst["free_blocks_start"], inst
    assert s["padding_tokens"] == 0 and s["flips_per_min"] == 0


def test_adaptive_late_binding_moves_unstarted_prompts_to_an_instance_with_room(tmp_path):
    """Heavy prompts in a burst on 1P+1D adaptive with a KV pool of a few prompts (HPLD at
    saturation): after the first, the decode instance has no room for them when they arrive, so
    they queue on the prefill instance; as its own requests end it takes the oldest unstarted
    ones (``placements.taken``) instead of leaving the prefill instance every prompt. Nothing is
    lost."""
    trace = [{"timestamp": 0.005 * i, "prompt_tokens": 700, "output_tokens": 3} for i in range(12)]
    # fp32 whatever the CPU: with dtype auto an AVX512-BF16 machine halves a token's KV, the pool
    # holds twice the prompts and the decode instance has room for half the burst
    report = replay_sim(tmp_path, trace, "--mode", "adaptive", "--prefill", "1", "--decode", "1",
                        "--max-num-batched-tokens", "256", "--predictor", "none", "--kv-cache-gb", "0.06",
                        "--dtype", "fp32")
    (s,) = report["systems"].values()
    placed = s["placements"]
    assert s["completed"] == 12 and placed["prefill"] + placed["decode"] == 12
    assert placed["decode"] == 1 and placed["taken"] >= 4, placed  # placed once there, taken later
    by_role = {i["role"]: i for i in s["instances"]}
    assert by_role["decode"]["prefill_tokens"] >= 5 * 699  # its own prompt and those it took
    for inst in s["instances"]:
        assert inst["free_blocks_end"] == inst["free_blocks_start"], inst


def test_kv_relief_moves_a_decode_instead_of_preempting_it_and_the_timeline_shows_where(tmp_path):
    """Long and short requests alternate on 1P+1D adaptive with a pool of about 80 blocks an
    instance: the prefill instance's long decodes outgrow its pool while the decode instance's
    short ones have ended. With --kv-relief (the default) decodes move by their KV and none is
    preempted; each landed move is in the report's move log (when, from, to, why) and on the
    timeline; with it off, the same replay preempts and nothing moves."""
    trace = [{"timestamp": 0.001 * i, "prompt_tokens": 60 + 10 * i, "output_tokens": 250 if i % 2 == 0 else 5}
             for i in range(10)]
    flags = ("--mode", "adaptive", "--prefill", "1", "--decode", "1", "--max-num-batched-tokens", "256",
             "--predictor", "none", "--kv-cache-gb", "0.06", "--dtype", "fp32", "--no-rebalance")
    (on,) = replay_sim(tmp_path, trace, *flags, "--plots", str(tmp_path / "plots"), name="on")["systems"].values()
    (off,) = replay_sim(tmp_path, trace, *flags, "--kv-relief", "off", name="off")["systems"].values()
    for s in (on, off):
        assert s["completed"] == 10 and s["output_tokens"] == sum(r["output_tokens"] for r in trace)
        for inst in s["instances"]:
            assert inst["free_blocks_end"] == inst["free_blocks_start"], inst
    assert off["preemptions"] > 0 and off["moves"] == 0 and off["move_log"] == []
    assert on["preemptions"] == 0 and on["moves"] == on["placements"]["relieved"] == len(on["move_log"]) > 0
    for m in on["move_log"]:
        assert (m["from"], m["to"], m["why"]) == ("p0", "d1", "relief") and 0 < m["at"] < on["makespan_s"], m
    assert (tmp_path / "plots" / "timeline.png").stat().st_size > 0


def test_tpot_placement_sees_each_running_decodes_room(tmp_path, monkeypatch):
    """At the tight-TPOT corner adaptive placement reads each running decode's TPOT room (a spy
    on the real placement records the loads it was given): rooms only for decodes, each with the
    tokens it has left (the predictor off: its ``max_tokens``, the trace's output) and at most its
    whole limit over its gaps; with --no-tpot-placement none. Every request completes either way."""
    from scheduling.placement import Placement

    seen = []
    choose = Placement.choose

    def spy(self, loads, n):
        seen.append((self.tpot_limit_s(), [ld.tpot_rooms for ld in loads]))
        return choose(self, loads, n)

    monkeypatch.setattr(Placement, "choose", spy)
    trace = [{"timestamp": 0.05 * i, "prompt_tokens": 40, "output_tokens": 20} for i in range(8)]
    flags = ("--mode", "adaptive", "--prefill", "1", "--decode", "1", "--predictor", "none", "--dtype", "fp32",
             "--slo", "tight-tpot")
    (on,) = replay_sim(tmp_path, trace, *flags, name="on")["systems"].values()
    rooms = [(limit, r) for limit, loads in seen for rs in loads for r in rs]
    assert len(seen) == 8 and rooms and all(limit > 0 for limit, _ in seen)
    for limit, (room, left) in rooms:
        assert 0 <= room <= limit * 19 and left == int(left) and 1 <= left <= 19, (room, left)
    seen.clear()
    (off,) = replay_sim(tmp_path, trace, *flags, "--no-tpot-placement", name="off")["systems"].values()
    assert len(seen) == 8 and all(limit is None and not any(loads) for limit, loads in seen)
    assert on["completed"] == off["completed"] == 8


def test_a_replay_refuses_a_profile_measured_at_other_threads(tmp_path, capsys):
    """Issue 58's case from the command line: a profile measured at two threads (``aserve profile
    device``'s default on this machine) and a 1P + 1D replay at one thread each is refused, with
    the command that measures the right profile; at two threads each it runs; with
    ``--allow-profile-mismatch`` it runs and says why it should not."""
    from aserve.commands import EXIT_USAGE, main
    from aserve.profiles.machine import cpu_flags, machine

    meta = {"model": "default", "device": "cpu", "dtype": "float32", "attention": "sdpa", "kernels": "fallback",
            "threads": 2, "machine": machine(), "cpu_flags": cpu_flags(), "date": date.today().isoformat(),
            "rest": {"at_rest": True}}
    profile = tmp_path / "P.json"
    profile.write_text(json.dumps(CostModel(FLAT.tokens, FLAT.linear_s, 0.0, 0.0, meta=meta).to_json()))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0.02 * i, "prompt_tokens": 40, "output_tokens": 4}) + "\n"
                             for i in range(6)))

    def replay(threads: int, *flags: str) -> int:
        return main(["replay", str(trace), "--device", f"sim:{profile}", "--mode", "disagg", "--prefill", "1",
                     "--decode", "1", "--threads", str(threads), "--dtype", "fp32", "--attention", "sdpa",
                     "--kernels", "fallback", "--predictor", "none", "--no-warmup", "--no-progress",
                     "--json", str(tmp_path / f"out{threads}{len(flags)}.json"), *flags])

    assert replay(2) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"sim:{profile} was measured for another engine than the one simulated: threads 2 in the profile, 1 " \
           "for these instances" in err
    assert f"aserve profile device --threads 1 --dtype fp32 --attention sdpa --kernels fallback --out {profile}" in err
    assert replay(4) == 0  # two threads each: what it measured
    assert replay(2, "--allow-profile-mismatch") == 0
    assert "used anyway (--allow-profile-mismatch)" in capsys.readouterr().err


def test_a_replay_on_the_h100_profile_completes(tmp_path):
    """The second shipped hardware profile from the command line: Llama-3-8B on H100s, coupled."""
    trace = [{"timestamp": 0.01 * i, "prompt_tokens": 200 + 150 * i, "output_tokens": 8 + i} for i in range(10)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in trace))
    out = tmp_path / "h100.json"
    from aserve.commands import main

    assert main(["replay", str(path), "--device", "sim:llama3-8b-h100-80gb", "--mode", "coupled", "--instances",
                 "2", "--predictor", "none", "--no-warmup", "--no-progress", "--json", str(out)]) == 0
    (s,) = json.loads(out.read_text())["systems"].values()
    assert s["completed"] == 10 and s["output_tokens"] == sum(r["output_tokens"] for r in trace)
    assert s["ttft"]["mean"] < 0.5  # prompts of 200-1,550 tokens at ~34k tokens/s, two instances

def test_a_replay_counts_prefix_cache_evictions_and_kv_moved(tmp_path):
    """Eight shared prefixes (four 16-token blocks each), each sent twice with a full block of its
    own after it (0, 1, 0, 1, 2, 3, 2, 3, ...), one request at a time: with a pool smaller than the
    48 full blocks the trace leaves cached the cache must evict, with room it evicts nothing and
    every second send finds its prefix, with the cache off nothing is cached. A coupled system
    hands no KV over: 0 bytes moved, not 'unknown'."""
    trace = [{"timestamp": 0.5 * i, "prompt_tokens": 80, "output_tokens": 4, "hash_block": 16,
              "hash_ids": [10 * (i // 4 * 2 + i % 2) + k for k in range(4)] + [1000 + i]} for i in range(16)]
    flags = ("--mode", "coupled", "--instances", "1", "--batching", "sarathi", "--predictor", "none")
    (small,) = replay_sim(tmp_path, trace, *flags, "--kv-cache-gb", "0.015", name="small")["systems"].values()
    (room,) = replay_sim(tmp_path, trace, *flags, "--kv-cache-gb", "0.25", name="room")["systems"].values()
    (off,) = replay_sim(tmp_path, trace, *flags, "--kv-cache-gb", "0.015", "--no-enable-prefix-caching",
                         name="off")["systems"].values()
    assert small["instances"][0]["free_blocks_start"] < 48 <= room["instances"][0]["free_blocks_start"]
    assert all(s["completed"] == 16 for s in (small, room, off))
    assert small["prefix_cache_evictions"] > 0 and room["prefix_cache_evictions"] == 0
    assert room["prefix_cache_hit_rate"] == pytest.approx(8 * 64 / (16 * 80))
    assert 0 < small["prefix_cache_hit_rate"] <= room["prefix_cache_hit_rate"]
    assert off["prefix_cache_evictions"] == 0 and not off["prefix_cache_hit_tokens"]
    for s in (small, room, off):
        assert s["kv_bytes_charged"] == 0 and s["kv_bytes_moved"] == 0 and s["kv_transfers"] == 0
