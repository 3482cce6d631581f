"""``aserve bench goodput``: the search alone on made-up attainment curves, its refusals, then real
searches on the simulated V100 (virtual time: seconds, no model weights)."""
import json

import pytest

from aserve.bench.goodput import Knee, Limits, Point, check_meetable, check_trace, pooled, search
from aserve.bench.goodput_report import limited_by
from aserve.devices.sim_device import load_profile
from aserve.replay.slo import UnloadedCosts, build_slo
from aserve.replay.traces import TraceRequest

V100 = UnloadedCosts(load_profile("opt-13b-v100-32gb").cost, "sim:opt-13b-v100-32gb")


def curve(knee: float, seen: list, noisy_at: float = None):
    """Attainment 1.0 up to ``knee`` req/s, falling past it (0.5 at twice the knee)."""
    def probe(rate: float) -> Point:
        seen.append(rate)
        a = 1.0 if rate <= knee else max(0.0, 1.0 - 0.5 * (rate - knee) / knee)
        if noisy_at is not None and abs(rate - noisy_at) < 1e-9:
            a = 0.5
        return Point(rate, a, round(100 * a), 100, {"ttft": 100 - round(100 * a)}, 100 / rate, 0.1)
    return probe


def test_the_search_brackets_then_bisects_to_the_precision():
    seen = []
    knee = search(curve(0.8, seen), Limits(start=0.1, floor=0.01, ceiling=100, precision=0.05, max_points=20))
    assert knee.bound == "within" and 0.91 <= knee.rate <= 0.96 < knee.bracket[1]  # attainment 0.9 at 0.96 req/s
    assert knee.bracket[1] / knee.rate <= 1.05 and knee.error == pytest.approx(knee.bracket[1] - knee.rate)
    assert seen[:4] == [0.1, 0.2, 0.4, 0.8] and len(knee.points) == len(seen) <= 10  # it says how many it ran
    down = search(curve(0.8, []), Limits(start=10, floor=0.01, ceiling=100))
    assert [p.rate for p in down.points][:3] == [10, 5, 2.5] and down.bound == "within"
    assert abs(down.rate - knee.rate) / knee.rate < 0.06 and limited_by(down) == "ttft"


def test_the_search_never_runs_unbounded():
    """Failing at the floor: no rate works; passing at the ceiling: the trace is too short; and
    never more points than --max-points."""
    below = search(curve(0.001, []), Limits(start=1, floor=0.05, ceiling=100))
    assert (below.rate, below.bound, below.bracket) == (None, "below", (None, 0.05))
    above = search(curve(1e9, []), Limits(start=1, floor=0.05, ceiling=100, max_points=20))
    assert (above.rate, above.bound) == (100, "at_least") and len(above.points) == 8  # 1 .. 64, then 100
    capped = search(curve(0.8, []), Limits(start=0.1, floor=0.01, ceiling=100, max_points=5))
    assert capped.bound == "max_points" and len(capped.points) == 5 and capped.rate is not None


def test_noise_near_the_knee_is_said_not_hidden():
    knee = search(curve(0.8, [], noisy_at=0.2), Limits(start=0.1, floor=0.01, ceiling=100))
    assert not knee.monotone or knee.rate < 0.2  # a fail at 0.2 below passes is flagged (or stops the bracket)


@pytest.mark.parametrize("kwargs, match", [({"target": 1.5}, "--target"), ({"precision": 0}, "--precision"),
                                           ({"max_points": 2}, "--max-points"), ({"floor": 5}, "bounds")])
def test_bad_search_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Limits(**{"start": 1, "floor": 0.1, "ceiling": 2, **kwargs})


def test_a_trace_too_short_and_an_slo_beyond_reach_are_refused_before_any_replay():
    reqs = [TraceRequest(i * 1.0, 1024, 64) for i in range(10)]
    with pytest.raises(ValueError, match=r"has 10 requests after fitting: a goodput search needs at least 20.*"
                                         r"--num-requests >= 20"):
        check_trace(reqs, "t.jsonl")
    reqs = [TraceRequest(i * 1.0, 1024, 64) for i in range(40)]
    slo = build_slo(None, ["ttft:50"])
    from dataclasses import replace

    slo = replace(slo, costs=V100)
    with pytest.raises(ValueError, match=r"SLO custom cannot be met by 90% of these requests at any rate: alone on "
                                         r"sim:opt-13b-v100-32gb only 0% would; ttft <= 50 ms: 0% of requests meet it "
                                         r"alone \(ttft:4\d\d ms or more would let 90%\)"):
        check_meetable(slo, reqs, 0.9)
    check_meetable(build_slo("tight-tpot", None, lambda: V100), reqs, 0.9)  # a corner is met alone by construction


def goodput(tmp_path, *argv):
    from aserve.commands import build_parser

    a = build_parser().parse_args(["bench", "goodput", "--device", "sim:opt-13b-v100-32gb", "--no-progress",
                                   *map(str, argv)])
    return a.func(a)


def trace_file(tmp_path, n: int):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i * 0.5, "prompt_tokens": 200 + 37 * (i % 9),
                                        "output_tokens": 20 + 11 * (i % 7)}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize("argv, match", [
    (["--slo", "tight"], "unknown SLO corner 'tight'"),
    (["--goodput", "ttft=250"], "bad --goodput item 'ttft=250'"),
    (["--slo", "balanced", "--rate", "2"], "--rate is what bench goodput searches"),
    ([], "bench goodput needs an SLO"),
    (["--goodput", "tpot:1"], r"SLO custom cannot be met by 90%.*tpot <= 1 ms"),
])
def test_bad_input_is_named_with_what_would_work(tmp_path, argv, match):
    with pytest.raises(ValueError, match=match):
        goodput(tmp_path, trace_file(tmp_path, 40), *argv)


def test_a_short_trace_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has 12 requests after fitting"):
        goodput(tmp_path, trace_file(tmp_path, 12), "--slo", "balanced")


def test_a_search_on_the_simulated_v100_writes_its_knee_points_and_plot(tmp_path):
    out, plot = tmp_path / "g.json", tmp_path / "g.png"
    assert goodput(tmp_path, trace_file(tmp_path, 60), "--slo", "balanced", "--max-points", "8", "--json", out,
                   "--plot", plot, "--compare", "vllm: --mode coupled --instances 2 --batching vllm ; "
                   "tetri: --mode disagg --prefill 1 --decode 1") == 0
    report = json.loads(out.read_text())
    assert set(report["about"]) == {"command", "commit", "dirty", "date", "machine"}
    assert report["about"]["command"].startswith("aserve ") and report["about"]["commit"]
    assert report["slo"]["name"] == "balanced" and report["slo"]["device"] == "sim:opt-13b-v100-32gb"
    for name, s in report["systems"].items():
        assert s["devices"] == 2 and s["predictor"] == "accuracy 65.7%"  # the fair default on sim:
        assert s["num_points"] == len(s["points"]) <= 8
        if s["knee_rate"] is not None:
            assert s["goodput_per_device"] == pytest.approx(s["knee_rate"] / 2)
            lo, hi = s["knee_bracket"]
            assert lo == s["knee_rate"] and (hi is None or hi > lo)
            assert any(r == lo and a >= 0.9 for r, a in s["points"])
        assert s["config"]["prefix_caching"] and s["config"]["prefix_aware_placement"]  # the defaults
        for p in s["points_detail"]:  # each point's cache and hand-overs: only the split moves KV
            assert p["prefix_cache_hit_rate"] is not None and p["prefix_cache_evictions"] >= 0
            assert (p["kv_bytes_moved"] > 0) == (name == "tetri")
    assert plot.stat().st_size > 10_000


def test_replays_of_one_rate_pool_every_request_once():
    """--repeats: a point is decided on every request of every replay; a run's figures are means."""
    a = Point(2.0, 115 / 128, 115, 128, {"ttft": 9, "tpot": 4}, 17.0, 40.0, 0.5, 2, 100, 0.2, 0.9)
    b = Point(2.0, 117 / 128, 117, 128, {"ttft": 8, "tpot": 3}, 19.0, 42.0, 0.7, 4, 300, 0.4, 1.1)
    p = pooled([a, b])
    assert (p.good, p.num_requests, p.attainment) == (232, 256, pytest.approx(232 / 256))
    assert p.attainment >= 0.9 > a.attainment  # a draw that failed alone passes with its twin
    assert p.misses == {"ttft": 17, "tpot": 7} and p.draws == (a.attainment, b.attainment) and p.repeats == 2
    assert (p.makespan_s, p.wall_s, p.hit_rate, p.kv_bytes_moved, p.ttft_p99_s) == (18.0, 82.0, pytest.approx(0.6), 200, 1.0)
    assert p.request_goodput == pytest.approx(116 / 18.0)  # a run's good requests a second, as one replay's
    assert pooled([a]) is a and a.repeats == 1 and a.request_goodput == pytest.approx(115 / 17.0)
    with pytest.raises(ValueError, match="share one rate"):
        pooled([a, Point(3.0, 1.0, 128, 128, {}, 10.0, 20.0)])


def test_repeats_are_refused_where_a_replay_is_the_same_every_time(tmp_path):
    with pytest.raises(ValueError, match="--repeats 3: a simulated device .* replays a rate the same way every time"):
        goodput(tmp_path, trace_file(tmp_path, 40), "--slo", "balanced", "--repeats", "3")
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        goodput(tmp_path, trace_file(tmp_path, 40), "--slo", "balanced", "--repeats", "0")


def test_a_real_search_pools_its_repeats_and_keeps_each_draw(tmp_path):
    """On the real CPU (the default model, two one-thread instances) each probed rate is replayed
    twice and decided on both replays' requests; the JSON keeps each replay's attainment."""
    from aserve.commands import build_parser

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i * 0.4, "prompt_tokens": 16 + 9 * (i % 5),
                                        "output_tokens": 3 + i % 4}) + "\n" for i in range(20)))
    out = tmp_path / "g.json"
    a = build_parser().parse_args(["bench", "goodput", str(path), "--device", "cpu", "--threads", "2", "--no-progress",
                                   "--kv-cache-gb", "0.25", "--slo", "tight-tpot", "--max-points", "3", "--repeats",
                                   "2", "--estimate-device", "sim:opt-13b-v100-32gb", "--json", str(out),
                                   "--compare", "sarathi: --mode coupled --instances 2 --batching sarathi"])
    assert a.func(a) == 0
    report = json.loads(out.read_text())
    assert report["search"]["repeats"] == 2
    s = report["systems"]["sarathi"]
    assert 1 <= s["num_points"] == len(s["points_detail"]) <= 3
    for p in s["points_detail"]:
        assert len(p["draws"]) == 2 and all(0 <= d <= 1 for d in p["draws"])
        assert p["attainment"] == pytest.approx(p["good"] / 40) == pytest.approx(sum(p["draws"]) / 2)


def test_knee_dataclass_reads_its_error_bar():
    k = Knee(0.5, (0.5, 0.52), "within", ())
    assert k.error == pytest.approx(0.02) and k.monotone


def test_the_estimate_is_the_search_simulated_on_the_twin(tmp_path, capsys):
    """A real device's search states its wall time first: the same search on its simulated twin
    (sim:local on a CPU), each point as long as its makespan; --estimate-only stops there."""
    assert goodput(tmp_path, trace_file(tmp_path, 40), "--slo", "balanced", "--estimate-only", "--max-points", "6",
                   "--estimate-device", "sim:opt-13b-v100-32gb",
                   "--compare", "vllm: --mode coupled --instances 2 --batching vllm") == 0
    out = capsys.readouterr().out
    assert "vllm: estimated wall time" in out and "knee near" in out
    with pytest.raises(ValueError, match="--estimate-device must be a simulated device"):
        goodput(tmp_path, trace_file(tmp_path, 40), "--slo", "balanced", "--estimate-device", "cpu")
    with pytest.raises(ValueError, match="--estimate-only is for a real CPU device"):
        goodput(tmp_path, trace_file(tmp_path, 40), "--slo", "balanced", "--estimate-only")


def test_a_search_with_a_twin_records_where_it_started(tmp_path):
    """The JSON keeps the twin's knee beside the measured one (the simulator's error on a real
    device); with the device as its own twin the two agree, and the search starts there."""
    out = tmp_path / "g.json"
    assert goodput(tmp_path, trace_file(tmp_path, 40), "--slo", "balanced", "--max-points", "8",
                   "--estimate-device", "sim:opt-13b-v100-32gb", "--json", out,
                   "--compare", "vllm: --mode coupled --instances 2 --batching vllm") == 0
    s = json.loads(out.read_text())["systems"]["vllm"]
    assert s["estimate_device"] == "sim:opt-13b-v100-32gb" and s["knee_rate"] is not None
    assert s["estimated_knee_rate"] == pytest.approx(s["knee_rate"]) and s["points"][0][0] == pytest.approx(s["knee_rate"])


def test_the_floor_is_where_each_request_arrives_after_the_last_would_have_finished_alone():
    """A mean gap would not do for a bursty trace (the Azure code trace: 41% of gaps under 5% of the
    mean): its bursts stay bursts at any rate, so the floor reads every gap."""
    from aserve.bench.goodput import search_bounds

    slo = build_slo("balanced", None, lambda: V100)
    even = [TraceRequest(float(i), 500, 100) for i in range(30)]
    bursty = [TraceRequest(i // 10 * 10 + (i % 10) * 0.01, 500, 100) for i in range(30)]
    alone = V100.alone(500, 100)["e2el"]
    assert search_bounds(slo, even)[0] == pytest.approx(1.0 / alone)  # 1 s apart at 1 req/s
    assert search_bounds(slo, bursty)[0] == pytest.approx(0.01 / alone)  # the 0.01 s gaps inside a burst
    assert search_bounds(slo, [TraceRequest(0.0, 500, 100)] * 30)[0] == pytest.approx(1.0 / alone)  # no gap at all
    ceiling = search_bounds(slo, even)[1]
    assert ceiling == pytest.approx(29 / V100.prefill_s(500))  # the whole trace within one median prefill
