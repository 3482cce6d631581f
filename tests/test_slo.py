"""SLOs (aserve/replay/slo.py): parsing, corners on a device's unloaded costs, and which requests
are good; hand-made records and the shipped simulated V100 profile (no model)."""
import pytest

from aserve.devices.sim_device import load_profile
from aserve.replay.report import RequestRecord
from aserve.replay.slo import CORNERS, Slo, Term, UnloadedCosts, attainment, build_slo, misses, parse_goodput

V100 = UnloadedCosts(load_profile("opt-13b-v100-32gb").cost, "sim:opt-13b-v100-32gb")


def record(times, arrival=0.0, prompt=100, status="completed"):
    return RequestRecord(0, prompt, len(times), arrival, status, arrival, times[0] if times else None,
                         times[-1] if times else None, tuple(times))


def test_vllm_goodput_form_in_milliseconds():
    terms = parse_goodput(["ttft:250", "tpot:100", "e2el:30000"])
    assert {k: t.seconds for k, t in terms.items()} == {"ttft": 0.25, "tpot": 0.1, "e2el": 30.0}
    assert parse_goodput(["token_gap:1000,jct:5000"]) == {"token_gap": Term(seconds=1.0), "e2el": Term(seconds=5.0)}


@pytest.mark.parametrize("items, match", [
    (["ttft=250"], r"bad --goodput item 'ttft=250': use KEY:MILLISECONDS"),
    (["latency:5"], r"bad --goodput key 'latency'.*ttft, tpot, token_gap, e2el"),
    (["itl:50"], r"itl is every gap of a run; a request's largest gap is token_gap"),
    (["ttft:fast"], r"bad --goodput value 'fast' for ttft: milliseconds"),
    (["tpot:0"], r"--goodput tpot must be > 0 \(no request meets a limit of 0\)"),
    (["tpot:-5"], r"must be > 0"), (["e2el:nan"], r"must be > 0"),
])
def test_a_malformed_goodput_spec_names_the_item_and_the_form(items, match):
    with pytest.raises(ValueError, match=match):
        parse_goodput(items)


def test_slo_text_corners_and_absolute_limits():
    slo = build_slo("ttft=1,tbt=200ms", None)  # the older key name of TPOT still reads
    assert slo.name == "custom" and dict(slo.terms) == {"ttft": Term(seconds=1.0), "tpot": Term(seconds=0.2)}
    with pytest.raises(ValueError, match="unknown SLO corner 'tight': use one of balanced, tight-ttft, tight-tpot"):
        build_slo("tight", None)
    with pytest.raises(ValueError, match="bad --slo key 'latency'"):
        build_slo("latency=1", None)
    with pytest.raises(ValueError, match="relative to the device's unloaded costs"):
        build_slo("balanced", None)  # a corner needs the device's costs
    assert build_slo(None, None) is None


def test_corners_are_multiples_of_the_devices_unloaded_costs():
    assert set(CORNERS) == {"balanced", "tight-ttft", "tight-tpot"}
    slo = build_slo("balanced", None, lambda: V100)
    step, prefill = V100.step_s(512), V100.prefill_s(512)
    limits = slo.limits(512, 100)
    assert limits["ttft"] == pytest.approx(3 * prefill + 5 * step)
    assert limits["tpot"] == pytest.approx(5 * V100.step_s(612)) and limits["token_gap"] == pytest.approx(25 * V100.step_s(612))
    assert 0.035 < step < 0.045 and 0.2 < prefill < 0.3  # OPT-13B on a V100: weight-bound step, compute-bound prompt
    tight_tpot, tight_ttft = (build_slo(c, None, lambda: V100).limits(512, 100) for c in ("tight-tpot", "tight-ttft"))
    assert tight_tpot["token_gap"] < limits["token_gap"] and tight_tpot["ttft"] > limits["ttft"]
    assert tight_ttft["ttft"] < limits["ttft"] and tight_ttft["tpot"] > limits["tpot"]
    # --goodput adds to a corner (or replaces one of its limits), and the name says so
    mixed = build_slo("balanced", ["e2el:60000"], lambda: V100)
    assert mixed.name == "balanced + e2el:60000" and mixed.limits(512, 100)["e2el"] == 60.0
    line = slo.describe([record([1.0, 1.1], prompt=512)])
    assert line.startswith("SLO balanced on sim:opt-13b-v100-32gb: ttft <= 3 x prefill + 5 x step = ")


def test_good_means_completed_and_every_limit_met():
    slo = Slo("custom", (("ttft", Term(seconds=0.5)), ("token_gap", Term(seconds=0.3))))
    ok = record([0.4, 0.5, 0.7])
    stalled = record([0.4, 0.5, 1.5])  # TPOT 0.55 would pass a mean; the one 1.0 s gap is what a reader sees
    late = record([0.9, 1.0])
    failed = record([], status="failed")
    assert misses(ok, slo) == () and misses(stalled, slo) == ("token_gap",) and misses(late, slo) == ("ttft",)
    assert misses(failed, slo) == ("failed",)
    a = attainment([ok, stalled, late, failed], slo)
    assert a == {"good": 1, "num_requests": 4, "slo_attainment": 0.25, "misses": {"ttft": 1, "token_gap": 1, "failed": 1}}
    one_token = record([0.2])  # no gap, TPOT 0 (vLLM's rule)
    assert misses(one_token, Slo("t", (("tpot", Term(seconds=0.01)), ("token_gap", Term(seconds=0.01))))) == ()


def test_an_slo_no_request_could_meet_alone_is_said_before_any_rate():
    reqs = [record([1.0, 1.1], prompt=1024) for _ in range(10)]
    tight = build_slo("ttft=50ms", None, lambda: V100)
    tight = Slo(tight.name, tight.terms, V100)
    assert tight.meetable_share(reqs) == 0.0  # a 1,024-token prompt alone takes ~0.47 s on the V100
    assert build_slo("balanced", None, lambda: V100).meetable_share(reqs) == 1.0


def test_a_simulated_replay_reports_attainment_goodput_and_the_predictor(tmp_path):
    """replay --slo CORNER on sim: (virtual time, no weights): the corner's limits printed and kept,
    attainment, request_goodput and per device per system, and each system's predictor named."""
    import json

    from aserve.commands import build_parser

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 0.2, "prompt_tokens": 300 + 50 * (i % 5),
                                         "output_tokens": 30 + 7 * (i % 4)}) + "\n" for i in range(24)))
    out = tmp_path / "r.json"
    a = build_parser().parse_args(["replay", str(trace), "--device", "sim:opt-13b-v100-32gb", "--no-progress",
                                   "--slo", "balanced", "--goodput", "e2el:60000", "--json", str(out), "--compare",
                                   "vllm: --mode coupled --instances 2 --batching vllm ; "
                                   "tetri: --mode disagg --prefill 1 --decode 1 --predictor oracle"])
    assert a.func(a) == 0
    report = json.loads(out.read_text())
    slo = report["trace"]["slo"]
    assert slo["name"] == "balanced + e2el:60000" and set(slo["terms"]) == {"ttft", "tpot", "token_gap", "e2el"}
    assert slo["device"] == "sim:opt-13b-v100-32gb" and slo["meetable_alone"] == 1.0
    assert report["trace"]["slo_line"].startswith("SLO balanced + e2el:60000 on sim:opt-13b-v100-32gb: ttft <= 3 x")
    for name, s in report["systems"].items():
        assert 0 < s["slo_attainment"] <= 1 and s["slo_good"] == round(s["slo_attainment"] * 24)
        assert s["devices"] == 2 and s["goodput_per_device"] == pytest.approx(s["request_goodput"] / 2)
        assert set(s["slo_misses"]) >= {"ttft", "tpot", "token_gap", "e2el"}
    assert report["systems"]["vllm"]["predictor_label"] == "accuracy 65.7%"  # the fair default on sim:
    assert report["systems"]["tetri"]["predictor_label"] == "oracle"  # asked for, and named
