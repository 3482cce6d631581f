"""benchmarks/step_speed.py: a run whose steps took longer for the same shapes reads as slower."""
import importlib.util
import json
import random
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_speed.py"
spec = importlib.util.spec_from_file_location("step_speed", SCRIPT)
step_speed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_speed)


def log(path, systems: dict[str, float], seed=0):
    """Decode-only steps of each system at ``speed`` times one cost model (plus 2% noise), and
    prompt steps the script must leave out."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for name, speed in systems.items():
            for _ in range(300):
                decodes = [rng.randint(10, 900) for _ in range(rng.randint(1, 16))]
                s = (0.09 + 0.007 * len(decodes) + 4e-5 * sum(decodes)) * speed * rng.uniform(0.98, 1.02)
                f.write(json.dumps({"system": name, "chunks": [], "decodes": decodes, "forward_s": s, "overlap": 1.0}) + "\n")
                f.write(json.dumps({"system": name, "chunks": [[200, 0]], "decodes": decodes, "forward_s": 9.0}) + "\n")


def test_speeds_follow_the_machine_not_the_shapes(tmp_path, capsys):
    log(tmp_path / "a.jsonl", {"fast": 0.9, "slow": 1.1})
    got = step_speed.speeds([str(tmp_path / "a.jsonl")])
    assert got["slow"][0] / got["fast"][0] == pytest.approx(1.1 / 0.9, rel=0.02) and got["fast"][1] == 300
    assert step_speed.main([str(tmp_path / "a.jsonl")]) == 0
    assert "| slow | 300 |" in capsys.readouterr().out
    (tmp_path / "empty.jsonl").write_text("")
    assert step_speed.main([str(tmp_path / "empty.jsonl")]) == 2
    assert "too few decode-only steps" in capsys.readouterr().err
