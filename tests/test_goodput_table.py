"""benchmarks/goodput_table.py --into: a later search of some systems replaces their cells and
curves in a committed result file, the other systems' stay, and the meta says what was merged."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "goodput_table.py"
spec = importlib.util.spec_from_file_location("goodput_table", SCRIPT)
goodput_table = importlib.util.module_from_spec(spec)
sys.modules["goodput_table"] = goodput_table
spec.loader.exec_module(goodput_table)


def _system(g, wall=3.0):
    return {"goodput_per_device": g, "knee_rate": 4 * g, "knee_bracket": [4 * g, 4.2 * g], "bound": "within",
            "limited_by": "ttft", "num_points": 6, "wall_s": wall, "predictor": "accuracy 65.7%",
            "monotone": True, "devices": 4, "points": [[4 * g, 0.93], [4.2 * g, 0.85]]}


def _committed(path):
    cells = [{"workload": "Mixed", "corner": "balanced", "system": n, "goodput_per_device": g}
             for n, g in (("vllm", 0.2), ("sarathi", 0.25), ("tetri", 0.18), ("adaptive", 0.26))]
    path.write_text(json.dumps({"meta": {"commit": "aaa", "date": "2026-11-29", "machine": "m1",
                                         "command": "goodput_paper.sh OUT", "wall_time": "54 min"},
                                "data": {"cells": cells, "curves": {"Mixed": {"balanced": {"adaptive": [[1, 1]],
                                                                                           "sarathi": [[2, 1]]}}}}}))


def _searched_again(tmp_path, cell: str, system: dict):
    """A committed file, and OUT3 holding one later search of adaptive in ``cell``."""
    committed = tmp_path / "goodput_paper.json"
    _committed(committed)
    out = tmp_path / "OUT3"
    out.mkdir()
    (out / f"{cell}.json").write_text(json.dumps({
        "systems": {"adaptive": system}, "about": {"commit": "bbb", "date": "2026-11-30T22:00:00+00:00", "machine": "m2"}}))
    return committed, out


def test_into_replaces_only_the_systems_searched_again(tmp_path):
    committed, out = _searched_again(tmp_path, "Mixed_balanced", _system(0.5, wall=120.0))
    assert goodput_table.main([str(out), "--into", str(committed)]) == 0
    got = json.loads(committed.read_text())
    by = {c["system"]: c for c in got["data"]["cells"]}
    assert by["adaptive"]["goodput_per_device"] == 0.5 and by["adaptive"]["workload"] == "Mixed"
    assert [by[n]["goodput_per_device"] for n in ("vllm", "sarathi", "tetri")] == [0.2, 0.25, 0.18]
    curves = got["data"]["curves"]["Mixed"]["balanced"]
    assert curves["adaptive"] == [[2.0, 0.93], [2.1, 0.85]] and curves["sarathi"] == [[2, 1]]
    meta = got["meta"]
    assert meta["commit"] == "aaa, bbb" and meta["date"] == "2026-11-29, 2026-11-30" and meta["machine"] == "m1; m2"
    assert meta["command"].endswith("--into " + str(committed)) and "SYSTEMS=adaptive" in meta["command"]
    assert meta["wall_time"] == "54 min; then 2 min (1 searches merged)"


def test_into_refuses_a_cell_the_committed_file_lacks(tmp_path):
    committed, out = _searched_again(tmp_path, "LPLD_balanced", _system(0.3))
    with pytest.raises(SystemExit, match="no LPLD balanced adaptive cell"):
        goodput_table.main([str(out), "--into", str(committed)])
