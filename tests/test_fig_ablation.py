"""benchmarks/fig_ablation.py's tables from a tiny fake OUT (pure: reports in, figures out), and its
grid's flags."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fig_ablation.py"
spec = importlib.util.spec_from_file_location("fig_ablation", SCRIPT)
fig_ablation = importlib.util.module_from_spec(spec)
sys.modules["fig_ablation"] = fig_ablation
spec.loader.exec_module(fig_ablation)


def _system(ttft, jct, tokens_per_s=10.0, busy=100.0, makespan=50.0, preemptions=0):
    return {"ttft": {"mean": ttft}, "jct": {"mean": jct}, "output_tokens_per_s": tokens_per_s,
            "resource_usage_s": busy, "makespan_s": makespan, "preemptions": preemptions}


def _write(out: Path, fig: str, cond: str, w: str, clipped: int = 0, **systems):
    path = out / fig / cond / f"{w}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"trace": {"num_clipped": clipped}, "systems": systems}))


def test_fig16_gains_and_the_unchanged_side_taken_from_ours(tmp_path):
    # ours, LPLD: TS 1 s / 6 s against vLLM 2 s / 8 s; TS twice the busy time for the same tokens/s
    _write(tmp_path, "fig16", "ours", "LPLD", clipped=3, **{"ts-roce": _system(1.0, 6.0, busy=200.0),
                                                           "vllm-1gpu": _system(2.0, 8.0, busy=100.0)})
    # e reruns only TS (the link): its vLLM is ours'
    _write(tmp_path, "fig16", "e", "LPLD", **{"ts-roce": _system(0.5, 4.0, busy=200.0)})
    # a reruns only vLLM
    _write(tmp_path, "fig16", "a", "LPLD", **{"vllm-1gpu": _system(4.0, 16.0)})
    d = fig_ablation.build(tmp_path)
    ours, e, a = (d["fig16"][c]["cells"]["LPLD"] for c in ("ours", "e", "a"))
    assert ours["ttft"] == pytest.approx(-0.5) and ours["jct"] == pytest.approx(-0.25)
    assert ours["perf"] == pytest.approx(0.5) and ours["clipped"] == 3
    assert e["ttft"] == pytest.approx(-0.75) and e["jct"] == pytest.approx(-0.5) and e["vllm_jct_s"] == 8.0
    assert a["jct"] == pytest.approx(6.0 / 16.0 - 1) and a["ts_jct_s"] == 6.0
    # b reruns both sides and has no report: missing, and so is every workload not written
    assert d["fig16"]["b"]["cells"]["LPLD"] is None and d["fig16"]["ours"]["cells"]["Mixed"] is None
    assert "fig16 b LPLD" in d["missing"] and "fig16 ours LPLD" not in d["missing"]
    text = fig_ablation.fig16_table(d["fig16"])
    assert "| ours: " in text and "-50% / **-25%** / 0.50x" in text and "missing" in text
    assert "-44% / -40%" in text  # the paper's row


def test_fig18_each_reservation_policy_against_greedy(tmp_path):
    _write(tmp_path, "fig18", "ours", "ShareGPT", clipped=117,
           **{"greedy": _system(1.0, 100.0, preemptions=50), "reserve-static": _system(2.0, 150.0),
              "reserve-dynamic": _system(1.5, 90.0, preemptions=5)})
    d = fig_ablation.build(tmp_path)
    c = d["fig18"]["ours"]["cell"]
    assert c["reserve-static"]["vs_greedy"] == pytest.approx(0.5)
    assert c["reserve-dynamic"]["vs_greedy"] == pytest.approx(-0.1)
    assert c["clipped"] == 117 and d["fig18"]["b"]["cell"] is None and "fig18 b" in d["missing"]
    text = fig_ablation.fig18_table(d["fig18"])
    assert "| 100.0 (50) | +50% (0) | **-10%** (5) | 50 | 117 |" in text


def test_the_grid_switches_on_one_condition_at_a_time(tmp_path):
    steps = {(c, w): argv for c, w, argv in fig_ablation.fig16_steps(tmp_path)}
    ours = steps[("ours", "HPHD")]
    assert "--rate" not in ours and ours[ours.index("--device") + 1] == "sim:opt-13b-v100-32gb"
    assert "accuracy=0.749" in ours
    b = steps[("b", "HPHD")]
    assert b[b.index("--rate") + 1] == "0.25" and "--no-enable-prefix-caching" not in b[-1]
    assert "--no-enable-prefix-caching" in steps[("a", "HPHD")][-1] and "ts-roce" not in steps[("a", "HPHD")][-1]
    assert "--link nvlink" in steps[("e", "HPHD")][-1] and "vllm-1gpu" not in steps[("e", "HPHD")][-1]
    f = steps[("f", "HPHD")]
    prof = json.loads(Path(f[f.index("--device") + 1].removeprefix("sim:")).read_text())
    assert prof["hardware"]["memory_bytes"] == 80 * 2**30
    assert steps[("c", "HPHD")][0] == str(tmp_path / "traces" / "HPHD.jsonl")
    everything = steps[("all", "HPHD")]
    assert "--rate" in everything and "--no-enable-prefix-caching" in everything[-1] and "80gib" in " ".join(everything)
    assert "--rate" not in steps[("all-r1", "HPHD")]
    fig18 = {c: argv for c, _, argv in fig_ablation.fig18_steps(tmp_path)}
    assert fig18["ours"][fig18["ours"].index("--rate") + 1] == "0.25"
    assert fig18["b"][fig18["b"].index("--rate") + 1] == "0.1"
    assert "accuracy=1.0" in fig18["d-oracle"] and "--predictor" not in fig18["d-serve"]
    fit = fig18["c"][0]
    rows = Path(fit).read_text().splitlines()[1:]
    assert rows and all(int(r.split(",")[2]) <= 2048 for r in rows)
