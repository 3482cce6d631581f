"""benchmarks/sim_heldout.py: the held-out table's errors, its step speed against the frozen profile
(whole run and per 30 s window), and the refusal of a profile not measured at rest."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from aserve.profiles.cost_model import CostModel

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sim_heldout.py"
spec = importlib.util.spec_from_file_location("sim_heldout", SCRIPT)
sim_heldout = importlib.util.module_from_spec(spec)
sys.modules["sim_heldout"] = sim_heldout
spec.loader.exec_module(sim_heldout)

MODEL = CostModel((1, 16, 64, 256, 1024), (0.010, 0.020, 0.050, 0.180, 0.700), attn_prefill_s=3e-7,
                  attn_decode_s=2e-6, meta={"date": "2026-11-29", "machine": "test", "threads": 1,
                                            "checks": [{"step": "decode 4", "error": -0.02}],
                                            "rest": {"at_rest": True, "why": []}})


def report(ttft: float, jct: float, gap99: float, attained: float) -> dict:
    def dist(mean, p99):
        return {"mean": mean, "p50": mean, "p90": p99, "p99": p99, "p999": p99, "max": p99}
    return {"ttft": dist(ttft, 2 * ttft), "jct": dist(jct, 2 * jct), "token_gap": dist(gap99 / 4, gap99),
            "slo_attainment": attained}


def write_workload(out: Path, profile: Path, slow_after_s: float = 60.0, slow: float = 1.5,
                   prompt_slow: float = 1.2) -> None:
    """Mixed: sarathi real against predicted, and a step log whose decode steps run at the
    profile's price for the first ``slow_after_s`` and ``slow`` times it after, and whose prompt
    steps run at ``prompt_slow`` times theirs throughout."""
    real = {"systems": {"sarathi": report(1.0, 8.0, 2.0, 0.9)}}
    sim = {"systems": {"sarathi": report(1.05, 6.0, 2.1, 1.0)}}  # TTFT +5%, JCT -25%, gap +5%
    (out / "Mixed_real.json").write_text(json.dumps(real))
    (out / "Mixed_sim.json").write_text(json.dumps(sim))
    lines, t = [], 0.0
    while t < 2 * slow_after_s:
        s = MODEL.step_s((), [100, 200], 0, 0, 2) * (slow if t >= slow_after_s else 1.0)
        lines.append({"system": "sarathi", "instance": "c0", "role": "coupled", "t": t, "chunks": [],
                      "decodes": [100, 200], "pad": 0, "sampled": 2, "swapped": 0, "forward_s": s, "busy_s": s,
                      "cpu_s": s, "neighbours": 0, "overlap": 0.0})
        t += 0.5
    for k in range(5):
        s = MODEL.step_s([(64, 0)], [], 0, 0, 1) * prompt_slow
        lines.append({"system": "sarathi", "instance": "c0", "role": "coupled", "t": t + k, "chunks": [[64, 0]],
                      "decodes": [], "pad": 0, "sampled": 1, "swapped": 0, "forward_s": s, "busy_s": s,
                      "cpu_s": s, "neighbours": 0, "overlap": 0.0})
    (out / "Mixed_steps.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    (out / "Mixed_meta.json").write_text(json.dumps({
        "workload": "Mixed", "rate": 0.5, "commit": "abc", "profile": str(profile),
        "profile_sha256": sim_heldout.sha256(profile), "steal_fraction": 0.01,
        "predicted_at": 1795900000.0, "real_wall_s": 120.0}))


def test_the_table_counts_the_misses_and_reads_the_steps_speed(tmp_path, capsys):
    profile = MODEL.save(tmp_path / "P.json")
    write_workload(tmp_path, profile)
    out_json = tmp_path / "heldout.json"
    assert sim_heldout.main(["table", str(tmp_path), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "1 of 3 cells over their limit" in text  # JCT -25% only
    assert "-25% !" in text and "+5%)" in text
    doc = json.loads(out_json.read_text())
    assert doc["meta"]["kind"] == "simulator" and doc["meta"]["commit"] == "abc"
    data = doc["data"]
    (row,) = data["rows"]
    speed = row["step_speed"]
    assert speed["lo"] == pytest.approx(1.0) and speed["hi"] == pytest.approx(1.5)  # the windows see the slowdown
    assert speed["speed"] == pytest.approx(1.25)  # the run's median: half its decode steps at each speed
    assert speed["prompt_speed"] == pytest.approx(1.2)  # prompt steps read apart from the decode steps
    assert row["attainment"] == [0.9, 1.0] and row["steal"] == 0.01
    assert data["over"] == 1 and data["cells"] == 3 and data["validations"] == []


def test_the_results_file_keeps_the_earlier_validations(tmp_path, capsys):
    profile = MODEL.save(tmp_path / "P.json")
    write_workload(tmp_path, profile)
    out_json = tmp_path / "heldout.json"
    old = [{"label": "11-24 profile alone", "fitted_on": None, "over": 72, "of": 108}]
    out_json.write_text(json.dumps({"meta": {}, "data": {"validations": old}}))
    assert sim_heldout.main(["table", str(tmp_path), "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["data"]["validations"] == old


def test_a_second_real_draw_is_the_machines_own_spread(tmp_path, capsys):
    """``--repeat``: each cell's second real run against the first, beside the simulator's error."""
    profile = MODEL.save(tmp_path / "P.json")
    write_workload(tmp_path, profile)
    again = tmp_path / "again"
    again.mkdir()
    (again / "Mixed_real.json").write_text(json.dumps({"systems": {"sarathi": report(1.3, 8.4, 2.0, 0.9)}}))
    out_json = tmp_path / "heldout.json"
    assert sim_heldout.main(["table", str(tmp_path), "--repeat", str(again), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "[again +30%]" in text and "[again +5%]" in text and "1 of 3 cells differ by more than the limit" in text
    cells = json.loads(out_json.read_text())["data"]["rows"][0]["cells"]
    assert [round(c["repeat"], 3) for c in cells] == [0.3, 0.05, 0.0]


def test_the_replaced_validation_becomes_an_earlier_one(tmp_path, capsys):
    """Writing over a held-out file keeps the one it replaces as a frozen earlier validation."""
    profile = MODEL.save(tmp_path / "P.json")
    write_workload(tmp_path, profile)
    out_json = tmp_path / "heldout.json"
    assert sim_heldout.main(["table", str(tmp_path), "--json", str(out_json), "--label", "first"]) == 0
    assert sim_heldout.main(["table", str(tmp_path), "--json", str(out_json), "--label", "second"]) == 0
    data = json.loads(out_json.read_text())["data"]
    assert data["label"] == "second"
    (first,) = data["validations"]
    assert first["label"] == "first" and first["frozen"] and (first["over"], first["of"]) == (1, 3)


def test_a_profile_not_at_rest_is_refused_before_anything_runs(tmp_path):
    busy = CostModel(MODEL.tokens, MODEL.linear_s, MODEL.attn_prefill_s, MODEL.attn_decode_s,
                     meta={"rest": {"at_rest": False, "why": ["other processes used 1.2 cores"]}})
    path = busy.save(tmp_path / "busy.json")
    with pytest.raises(SystemExit, match="not measured at rest.*1.2 cores"):
        sim_heldout.main(["run", str(tmp_path / "out"), "--profile", str(path), "--workloads", "Mixed"])
    assert not (tmp_path / "out").exists()


def test_an_unknown_workload_or_system_is_named(tmp_path):
    path = MODEL.save(tmp_path / "P.json")
    with pytest.raises(SystemExit, match="unknown workload 'Chat'"):
        sim_heldout.main(["run", str(tmp_path / "out"), "--profile", str(path), "--workloads", "Chat"])
    with pytest.raises(SystemExit, match="unknown system 'orca'"):
        sim_heldout.main(["run", str(tmp_path / "out"), "--profile", str(path), "--systems", "orca"])
