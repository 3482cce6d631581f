"""benchmarks/adaptive_table.py: labels, pooling, --mean over several runs of a workload, and the marks
with their differences."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "adaptive_table.py"
spec = importlib.util.spec_from_file_location("adaptive_table", SCRIPT)
adaptive_table = importlib.util.module_from_spec(spec)
sys.modules["adaptive_table"] = adaptive_table
spec.loader.exec_module(adaptive_table)


def _system(ttft, jct, gap=0.2, busy=20.0, tokens=100, makespan=10.0, completed=4):
    return {"ttft": {"mean": ttft}, "jct": {"mean": jct}, "token_gap": {"p99": gap}, "resource_usage_s": busy,
            "output_tokens_per_s": tokens / makespan, "output_tokens": tokens, "makespan_s": makespan,
            "instances": [{}, {}], "completed": completed, "failed": 0, "aborted": 0}


def _report(path, **systems):
    path.write_text(json.dumps({"systems": systems}))
    return str(path)


def test_verdict_marks_and_the_signed_difference():
    assert adaptive_table.verdict(1.0, 1.0, 0.03) == "ok (+0.0%)"
    assert adaptive_table.verdict(1.02, 1.0, 0.03) == "= (+2.0%)"
    assert adaptive_table.verdict(1.05, 1.0, 0.03) == "WORSE (+5.0%)"
    assert adaptive_table.verdict(0.96, 1.0, 0.03, higher_better=True) == "WORSE (-4.0%)"
    assert adaptive_table.verdict(1.1, 1.0, 0.03, higher_better=True) == "ok (+10.0%)"


def test_mean_averages_each_system_over_the_runs_of_one_label(tmp_path, capsys):
    # adaptive: TTFT 1.0 and 1.4 (mean 1.2); vllm 1.1 and 1.3 (mean 1.2); sarathi 2.0: a tie at +0.0%
    a = _report(tmp_path / "x0.98.json", adaptive=_system(1.0, 9.0), vllm=_system(1.1, 10.0), sarathi=_system(2.0, 9.5))
    b = _report(tmp_path / "x1.02.json", adaptive=_system(1.4, 9.0), vllm=_system(1.3, 10.0), sarathi=_system(2.0, 9.5))
    assert adaptive_table.main([f"LPLD={a}", f"LPLD={b}", "--mean"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| LPLD") or line.startswith("|  |")]
    row = next(line for line in lines if "adaptive (mean of 2)" in line)
    cells = [c.strip() for c in row.split("|")]
    assert cells[3] == "1.200" and cells[10] == "8/8"
    assert cells[11].startswith("ok (+0.0%) / ok (-5.3%) / ok (+0.0%)")  # JCT 9.0 against sarathi's 9.5
    assert any("vllm (mean of 2)" in line and "| 1.200 |" in line for line in lines)


def test_without_mean_a_later_report_replaces_and_labels_default_to_the_file_name(tmp_path, capsys):
    a = _report(tmp_path / "run_HPLD.json", adaptive=_system(5.0, 9.0), vllm=_system(1.0, 9.0), sarathi=_system(1.0, 9.0))
    b = _report(tmp_path / "again_HPLD.json", adaptive=_system(1.0, 9.0))
    assert adaptive_table.main([a, b]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "| adaptive |" in line)
    assert row.startswith("| HPLD |") and "| 1.000 |" in row and "mean of" not in row


def test_a_file_that_is_not_a_report_is_named(tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="notes.json is not a replay report"):
        adaptive_table.main([str(bad)])
    with pytest.raises(SystemExit, match="missing.json is not a replay report"):
        adaptive_table.main([f"LPLD={tmp_path / 'missing.json'}"])
