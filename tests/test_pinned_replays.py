"""benchmarks/pinned_replays.sh refuses a plan it cannot run before it loads or measures anything:
an unknown system or trace, or more systems than the machine has pairs of cores for."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(tmp_path, *lanes):
    return subprocess.run(["bash", "benchmarks/pinned_replays.sh", str(tmp_path / "out"), "10", *lanes], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_bad_plans_are_refused_with_the_reason(tmp_path):
    r = run(tmp_path, "LPLD:adaptive,orca")
    assert r.returncode == 2 and "unknown system 'orca' in lane 'LPLD:adaptive,orca'" in r.stderr
    r = run(tmp_path, "LPLD,Nope:vllm")
    assert r.returncode == 2 and "no trace traces/Nope.jsonl" in r.stderr
    lanes = ["LPLD"] * ((os.cpu_count() or 1) // 6 + 1)  # three systems a lane, two cores each
    r = run(tmp_path, *lanes)
    assert r.returncode == 2 and f"the lanes need {6 * len(lanes)} cores" in r.stderr
    assert not (tmp_path / "out" / "profile.log").exists()
