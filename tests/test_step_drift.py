"""benchmarks/step_drift.py: each request's TTFT rebuilt from a step log equals the log's own times, and
an instance whose steps ran slow shows in its windows and in the requests that waited on it."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from aserve.profiles.cost_model import CostModel

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_drift.py"
spec = importlib.util.spec_from_file_location("step_drift", SCRIPT)
step_drift = importlib.util.module_from_spec(spec)
sys.modules["step_drift"] = step_drift  # its dataclasses look their module up there
spec.loader.exec_module(step_drift)

MODEL = CostModel((1, 16, 64, 256, 1024), (0.010, 0.020, 0.050, 0.180, 0.700), attn_prefill_s=3e-7,
                  attn_decode_s=2e-6)


def write_run(tmp_path, slow: float = 1.3):
    """Two coupled instances: c0's steps take ``slow`` times the model's price, c1's exactly it.
    r0 (300 tokens) is cut by the budget and finishes in c0's second step beside r3 (50); r1 and
    r2 have the same length (100) and follow each other on c1. Returns the files and each
    request's first-token time as the log has it."""
    clock = {"c0": 0.0, "c1": 0.5}
    lines, first = [], {}

    def step(inst, chunks, decodes, sampled, done=()):
        factor = slow if inst == "c0" else 1.0
        s = MODEL.step_s(chunks, decodes, 0, 1, sampled) * factor
        lines.append({"system": "sarathi", "instance": inst, "role": "coupled", "t": clock[inst], "chunks": chunks,
                      "decodes": decodes, "pad": 0, "sampled": sampled, "swapped": 0, "forward_s": s, "busy_s": s,
                      "cpu_s": s, "neighbours": 1, "overlap": 1.0})
        clock[inst] += s
        for r in done:
            first[r] = clock[inst]

    step("c0", [[256, 0]], [], 0)
    step("c0", [[44, 256], [50, 0]], [], 2, done=(0, 3))
    step("c0", [], [301, 51], 2)
    step("c1", [[100, 0]], [], 1, done=(1,))
    step("c1", [[100, 0]], [101], 2, done=(2,))
    step("c1", [], [102, 101], 2)
    lines.append({**lines[0], "system": "vllm"})  # another system's step: left out
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(d) + "\n" for d in lines))
    arrivals = [(0.0, 300), (0.5, 100), (0.55, 100), (0.1, 50)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": a, "prompt_tokens": p, "output_tokens": 4}) + "\n"
                             for a, p in arrivals))
    profile = tmp_path / "profile.json"
    MODEL.save(profile)
    return log, trace, profile, arrivals, first


def test_first_tokens_are_the_logs_own_and_the_slow_instance_shows(tmp_path, capsys):
    log, trace, profile, arrivals, first = write_run(tmp_path)
    steps = step_drift.load(str(log), "sarathi", MODEL)
    assert len(steps) == 6
    got, unmatched = step_drift.first_tokens(steps, arrivals)
    assert unmatched == 0 and sorted(f.request for f in got) == [0, 1, 2, 3]
    for f in got:
        assert f.ttft == pytest.approx(first[f.request] - arrivals[f.request][0])
        assert f.instance == ("c0" if f.request in (0, 3) else "c1")
        assert f.drift == pytest.approx(1.3 if f.instance == "c0" else 1.0)
    # r1 and r2 have one length: first come first served gives each its own chain (the loop above
    # would fail on a swap, their first tokens being 0.08 s apart)
    assert first[2] - first[1] > 0.05
    ws = step_drift.windows(steps, 10.0)
    assert ws["c0"][0][1] == 3 and ws["c0"][0][2] / ws["c0"][0][3] == pytest.approx(1.3)
    assert ws["c1"][0][2] / ws["c1"][0][3] == pytest.approx(1.0)

    assert step_drift.main([str(log), "--system", "sarathi", "--profile", str(profile), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 3, 1.300 | 3, 1.000 |" in out and "TTFT rebuilt for 4 of 4 requests (0 prompts not followed)" in out
    assert "| 0 | 0.0 | 300 | c0 |" in out


def test_a_prompt_whose_first_chunks_are_not_in_the_log_is_counted_not_guessed(tmp_path):
    log, _, _, arrivals, _ = write_run(tmp_path)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    log.write_text("".join(json.dumps(d) + "\n" for d in lines[1:]))  # r0's first chunk is gone
    got, unmatched = step_drift.first_tokens(step_drift.load(str(log), "sarathi", MODEL), arrivals)
    assert sorted(f.request for f in got) == [1, 2, 3] and unmatched == 1


def test_bad_input_is_named(tmp_path, capsys):
    log, trace, profile, _, _ = write_run(tmp_path)
    assert step_drift.main([str(log), "--system", "nobody", "--profile", str(profile)]) == 2
    assert "no steps of system 'nobody'" in capsys.readouterr().err
    assert step_drift.main([str(log), "--system", "sarathi", "--profile", str(tmp_path / "none.json")]) == 2
    assert "step_drift:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step_drift.main([str(log), "--system", "sarathi", "--profile", str(profile), "--window", "0"])
    assert "--window must be above 0" in capsys.readouterr().err
