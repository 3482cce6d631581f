"""benchmarks/arrival_spread.py: the stretch factors, the trace clock it multiplies, the sign of each
criterion, and a real sweep of three systems on a simulated device."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from aserve.profiles.cost_model import CostModel

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "arrival_spread.py"
spec = importlib.util.spec_from_file_location("arrival_spread", SCRIPT)
arrival_spread = importlib.util.module_from_spec(spec)
sys.modules["arrival_spread"] = arrival_spread
spec.loader.exec_module(arrival_spread)

FLAT = CostModel(tokens=(1, 1001), linear_s=(0.011, 1.011), attn_prefill_s=0.0, attn_decode_s=0.0)


def test_stretch_factors_from_a_range_or_a_list_and_bad_ones_named():
    assert arrival_spread.stretches("0.95:1.05:0.05") == [0.95, 1.0, 1.05]
    assert arrival_spread.stretches("0.9,1,1.2") == [0.9, 1.0, 1.2]
    for bad in ("1:0.9:0.1", "0.9:1:0", "a,b", "0,1", "1:2"):
        with pytest.raises(SystemExit, match="--stretch"):
            arrival_spread.stretches(bad)


def test_a_time_scale_given_is_multiplied_and_one_missing_is_added():
    assert arrival_spread.stretched_args(["t.jsonl", "--time-scale", "1.5", "--no-progress"], 1.1) == \
        ["t.jsonl", "--time-scale", repr(1.5 * 1.1), "--no-progress"]
    assert arrival_spread.stretched_args(["t.jsonl", "--time-scale=2"], 0.5) == ["t.jsonl", "--time-scale=1.0"]
    assert arrival_spread.stretched_args(["t.jsonl"], 0.97) == ["t.jsonl", "--time-scale", "0.97"]


def _system(ttft, jct, gap, busy, tokens=100, makespan=10.0):
    return {"ttft": {"mean": ttft}, "jct": {"mean": jct}, "token_gap": {"p99": gap}, "resource_usage_s": busy,
            "output_tokens_per_s": tokens / makespan, "output_tokens": tokens, "makespan_s": makespan,
            "instances": [{}, {}], "completed": 4, "failed": 0, "aborted": 0}


def test_each_criterion_against_the_better_baseline_positive_when_adaptive_is_worse():
    systems = {"vllm": _system(1.0, 10.0, 0.5, 20.0), "sarathi": _system(2.0, 8.0, 0.2, 16.0),
               "adaptive": _system(1.1, 8.0, 0.1, 20.0, makespan=8.0)}
    d = arrival_spread.differences(systems, "adaptive")
    assert d["mean TTFT"] == pytest.approx(0.1)  # against vllm's 1.0
    assert d["mean JCT"] == pytest.approx(0.0)  # sarathi's 8.0
    assert d["P99 token gap"] == pytest.approx(-0.5)  # against sarathi's, not the better one
    # perf/$: adaptive 12.5 tok/s over 20 busy s against sarathi's 10 over 16: adaptive worse
    assert d["perf/$ (busy)"] == pytest.approx((10 / 16) / (12.5 / 20) - 1)
    assert d["per instance-s"] == pytest.approx(-0.2)  # 100 tokens in 8 s against 10 s
    with pytest.raises(SystemExit, match="no system named sarathi"):
        arrival_spread.differences({"vllm": systems["vllm"], "adaptive": systems["adaptive"]}, "adaptive")


def test_a_sweep_on_a_simulated_device_runs_each_factor_once(tmp_path, capsys):
    (tmp_path / "flat.json").write_text(json.dumps(FLAT.to_json()))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0.02 * i, "prompt_tokens": 40 + 30 * (i % 3),
                                         "output_tokens": 3 + i % 4}) + "\n" for i in range(10)))
    compare = ("vllm: --mode coupled --instances 2 --batching vllm ; "
               "sarathi: --mode coupled --instances 2 --batching sarathi ; "
               "adaptive: --mode adaptive --prefill 1 --decode 1")
    args = [str(tmp_path / "out"), "--stretch", "0.9,1.1", "--", str(trace), "--device", f"sim:{tmp_path / 'flat.json'}",
            "--no-warmup", "--no-progress", "--predictor", "none", "--max-num-batched-tokens", "64", "--compare", compare]
    assert arrival_spread.main(args) == 0
    table = capsys.readouterr().out
    runs = {f: json.loads((tmp_path / "out" / f"stretch_{f}.json").read_text())["systems"] for f in ("0.9", "1.1")}
    for systems in runs.values():
        assert set(systems) == {"vllm", "sarathi", "adaptive"} and all(s["completed"] == 10 for s in systems.values())
    # the two factors are two different arrival clocks: the last request arrives 0.18 s x factor in
    assert runs["0.9"]["vllm"]["makespan_s"] != runs["1.1"]["vllm"]["makespan_s"]
    row = next(line for line in table.splitlines() if line.startswith("| mean TTFT"))
    expected = 100 * arrival_spread.differences(runs["0.9"], "adaptive")["mean TTFT"]
    assert row.split("|")[2].strip() == f"{expected:+.1f}"
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == 1 + 5  # header + criteria
    stamp = (tmp_path / "out" / "stretch_0.9.json").stat().st_mtime_ns
    assert arrival_spread.main(args) == 0  # both there: nothing run again
    assert (tmp_path / "out" / "stretch_0.9.json").stat().st_mtime_ns == stamp
    for extra in (["--json", "x.json"], ["--json=x.json"]):
        with pytest.raises(SystemExit, match="--json"):
            arrival_spread.main(args + extra)
