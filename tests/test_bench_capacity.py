"""``aserve bench capacity``: the bisection and the SLO judgement alone, then one real run."""
import json

import pytest

from aserve.bench.capacity import Probe, bisect_capacity, judge


def fake(limit: float, seen: list):
    def probe(rate: float) -> Probe:
        seen.append(rate)
        return Probe(rate, rate <= limit, 0.1, 0.1, 10, 10)
    return probe


def test_bisection_closes_in_on_the_limit():
    seen = []
    cap, bound, probes = bisect_capacity(fake(0.8, seen), 0.1, 4.0, 8)
    assert bound == "within" and len(probes) == 10 and seen[:2] == [4.0, 0.1]
    assert cap <= 0.8 and 0.8 / cap < 1.05  # the geometric bracket after 8 halvings of log(40)
    assert all(p.passed == (p.rate <= 0.8) for p in probes)


def test_bisection_bounds():
    assert bisect_capacity(fake(10, []), 0.1, 4.0, 5)[:2] == (4.0, "at_least")
    assert bisect_capacity(fake(0.01, []), 0.1, 4.0, 5)[:2] == (None, "below")
    with pytest.raises(ValueError, match="rate-lo"):
        bisect_capacity(fake(1, []), 2.0, 1.0, 3)


def test_judge_needs_every_request_and_both_slos():
    ok = {"completed": 4, "token_gap": {"p99": 0.2}, "queue_time": {"p50": 0.5}}
    assert judge(ok, 4, 1.0, 0.3, 1.0).passed
    assert not judge({**ok, "completed": 3}, 4, 1.0, 0.3, 1.0).passed
    assert not judge(ok, 4, 1.0, 0.1, 1.0).passed  # TBT over the SLO
    assert not judge(ok, 4, 1.0, 0.3, 0.4).passed  # scheduling delay over the limit
    assert not judge({**ok, "token_gap": {"p99": None}}, 4, 1.0, 0.3, 1.0).passed  # no token gap measured


def capacity_args(*argv):
    from aserve.commands import build_parser

    return build_parser().parse_args(["bench", "capacity", *map(str, argv)])


def test_rate_is_searched_not_given(tmp_path):
    a = capacity_args(tmp_path / "t.jsonl", "--rate", "1")
    with pytest.raises(ValueError, match="--rate is what bench capacity searches"):
        a.func(a)


@pytest.mark.long
@pytest.mark.slow
def test_capacity_on_the_default_model(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"prompt_tokens": 24 + 8 * i, "output_tokens": 6}) + "\n" for i in range(6)))
    # chunk and budget given: the search is under test, not the derivation (which profiles the engine
    # at every thread count on a fresh machine)
    common = ["--rate-lo", "0.5", "--rate-hi", "50", "--steps", "0", "--kv-cache-gb", "0.05", "--no-progress",
              "--chunk-size", "64", "--max-num-batched-tokens", "512"]
    out = tmp_path / "easy.json"
    a = capacity_args(trace, "--compare", "one: --mode coupled --instances 1", "--tbt-p99", "30", "--delay-p50", "30",
                      "--json", out, *common)
    assert a.func(a) == 0
    report = json.loads(out.read_text())
    one = report["systems"]["one"]
    assert (one["bound"], one["capacity_rps"], one["capacity_vs_first"]) == ("at_least", 50, 1.0)
    assert one["probes"][0]["completed"] == 6 and one["probes"][0]["tbt_p99_s"] > 0
    assert report["slo"] == {"tbt_p99_s": 30, "delay_p50_s": 30} and report["trace"]["num_requests"] == 6
    out = tmp_path / "strict.json"  # no CPU emits tokens 1 us apart: even the lowest rate fails
    a = capacity_args(trace, "--mode", "coupled", "--tbt-p99", "1e-6", "--json", out, *common)
    assert a.func(a) == 0
    (strict,) = json.loads(out.read_text())["systems"].values()
    assert strict["bound"] == "below" and strict["capacity_rps"] is None and len(strict["probes"]) == 2
