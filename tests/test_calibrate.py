"""Calibrating the simulated device on steps timed inside replays: the step log (aserve replay
--step-log) and the refit (aserve profile device --from-steps, aserve/profiles/calibrate.py)."""
from __future__ import annotations

import json
import random

import pytest

from aserve.profiles.calibrate import errors, fit, predict, scaled, speed, speed_trace
from aserve.profiles.cost_model import CostModel
from aserve.engine.step_log import LoggedStep, read_steps
from tests.step_log_support import check_step_log

TRUE = CostModel((1, 4, 16, 64, 256, 1024), (0.010, 0.012, 0.020, 0.050, 0.180, 0.700), attn_prefill_s=3e-7,
                 attn_decode_s=2e-6, contention=0.15, logits_row_s=1.2e-4)


def synthetic_steps(model: CostModel, n: int, noise: float, seed: int = 0, max_decodes: int = 1100) -> list[LoggedStep]:
    """Steps of every kind drawn from ``model``, times with lognormal noise. Each step's decodes sit
    near one context (16, 256 or 2048), so a row's cost and its context's are told apart."""
    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        kind = rng.choice(("prefill", "decode", "mixed"))
        chunks = [(rng.randint(8, 900), rng.choice((0, 256, 1024)))] if kind != "decode" else []
        ctx = rng.choice((16, 256, 2048))
        num_decodes = rng.choice((rng.randint(1, 64), rng.randint(1, max_decodes)))
        decodes = [rng.randint(ctx // 2, ctx) for _ in range(num_decodes)] if kind != "prefill" else []
        sampled = len(decodes) + (rng.random() < 0.3 if chunks else 0)
        busy = int(rng.random() < 0.5)
        t = model.step_s(chunks, decodes, 0, busy, sampled) * rng.lognormvariate(0, noise)
        steps.append(LoggedStep(tuple(chunks), tuple(decodes), 0, sampled, t, busy))
    return steps


def test_the_fit_recovers_a_known_cost_model_from_noisy_steps():
    steps = synthetic_steps(TRUE, 3000, noise=0.03)
    # a base 20% slow on every row, with the attention terms off and no contention or logits measured
    base = CostModel(TRUE.tokens, tuple(1.2 * y for y in TRUE.linear_s), 2e-7, 3e-6)
    fitted = fit(base, steps)
    for y, true in zip(fitted.linear_s, TRUE.linear_s):
        assert y == pytest.approx(true, rel=0.03)
    assert fitted.attn_prefill_s == pytest.approx(TRUE.attn_prefill_s, rel=0.05)
    assert fitted.attn_decode_s == pytest.approx(TRUE.attn_decode_s, rel=0.05)
    assert fitted.logits_row_s == pytest.approx(TRUE.logits_row_s, rel=0.1)
    assert fitted.contention == pytest.approx(TRUE.contention, abs=0.01)
    before, after = errors(base, steps), errors(fitted, steps)
    assert set(after) == {"prefill", "decode", "mixed", "all"}
    for kind, e in after.items():
        assert e.median < 0.03 and e.p90 < 0.06 and abs(e.total) < 0.01, kind  # the noise's size, no bias
        assert before[kind].median > 0.1
    # held out: steps the fit never saw, from the same model, are as close
    assert errors(fitted, synthetic_steps(TRUE, 500, noise=0.03, seed=1))["all"].median < 0.03


def test_the_ridge_keeps_grid_points_no_step_touched_and_the_grid_grows_to_the_longest_step():
    base = CostModel(TRUE.tokens, tuple(1.2 * y for y in TRUE.linear_s), TRUE.attn_prefill_s, TRUE.attn_decode_s)
    short = synthetic_steps(TRUE, 800, noise=0.02, max_decodes=60)
    short = [s for s in short if s.rows <= 64]  # only the table's points up to 64 rows are touched
    fitted = fit(base, short)
    assert fitted.tokens == base.tokens
    assert fitted.linear_s[4:] == base.linear_s[4:]  # 256 and 1,024 rows: exactly the base's
    assert fitted.linear_s[3] == pytest.approx(TRUE.linear_s[3], rel=0.05)  # 64 rows: the steps' value
    assert fitted.linear_s[2] == pytest.approx(TRUE.linear_s[2], rel=0.05)
    # no step beside a busy neighbour and no contention in the base: none fitted
    alone = fit(base, [s for s in short if not s.neighbours])
    assert alone.contention == 0.0
    # a 3,000-row prompt: the grid doubles to 4,096, the new points' prior the base's extrapolation
    long = [LoggedStep(((3000, 0),), (), 0, 1, TRUE.step_s([(3000, 0)], num_sampled=1), 0)]
    one = fit(base, short + long)  # one step moves the new points part of the way: the ridge holds them
    grown = fit(base, short + 50 * long)  # fifty insist
    assert grown.tokens == base.tokens + (2048, 4096)
    assert grown.linear_s[4:6] == base.linear_s[4:6]  # still untouched: 3,000 rows lie between 2,048 and 4,096
    assert grown.step_s([(3000, 0)], num_sampled=1) == pytest.approx(long[0].seconds, rel=0.01)
    assert grown.step_s([(3000, 0)], num_sampled=1) < one.step_s([(3000, 0)], num_sampled=1) \
        < base.step_s([(3000, 0)], num_sampled=1)


def test_a_sim_replay_logs_its_steps_and_the_fit_refits_its_profile(tmp_path, capsys):
    """On a simulated device a step's logged time is its cost model's time for the logged shape
    exactly, so the shapes are checked to the last token; refitting from a base 30% off brings the
    error near nothing, and the command line writes a profile a sim can run on."""
    from aserve.commands import main

    true = CostModel((1, 16, 64, 256), (0.004, 0.008, 0.020, 0.070), 2e-7, 1e-6, logits_row_s=5e-5)
    (tmp_path / "true.json").write_text(json.dumps(true.to_json()))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0.02 * i, "prompt_tokens": 20 + 9 * i,
                                         "output_tokens": 4 + i % 5}) + "\n" for i in range(16)))
    log, out = tmp_path / "steps.jsonl", tmp_path / "report.json"
    assert main(["replay", str(trace), "--device", f"sim:{tmp_path / 'true.json'}", "--no-progress", "--json", str(out),
                 "--step-log", str(log), "--predictor", "none", "--chunk-size", "32",
                 "--compare", "tetri: --mode disagg ; "
                              "sarathi: --mode coupled --instances 2 --max-num-batched-tokens 64"]) == 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    report = json.loads(out.read_text())["systems"]
    for name in ("tetri", "sarathi"):
        check_step_log(lines, name, report[name])
    steps = read_steps([log])
    assert len(steps) == len(lines) and {s.kind for s in steps} == {"prefill", "decode", "mixed"}
    for s in steps:
        assert s.seconds == pytest.approx(true.step_s(s.chunks, s.decodes, s.pad, s.neighbours, s.sampled))
    base = CostModel(true.tokens, tuple(1.3 * y for y in true.linear_s), 1.3 * true.attn_prefill_s, true.attn_decode_s)
    base.save(tmp_path / "base.json")
    fitted_path = tmp_path / "fitted.json"
    assert main(["profile", "device", "--from-steps", str(log), "--base", str(tmp_path / "base.json"),
                 "--out", str(fitted_path), "--check", str(log), "--systems", "tetri,sarathi"]) == 0
    fitted = CostModel.load(fitted_path)
    calibrated = fitted.meta["calibrated"]
    assert calibrated["fitted"]["before"]["all"]["median"] > 0.15
    # what 210 steps leave to the ridge (a grid point few steps touch stays nearer the base) is small
    assert calibrated["fitted"]["after"]["all"]["median"] < 0.01 and calibrated["fitted"]["after"]["all"]["p90"] < 0.03
    assert calibrated["check"]["after"] == calibrated["fitted"]["after"]  # the same log, checked
    assert calibrated["target"] == "forward_s" and calibrated["fitted"]["after"]["all"]["steps"] == len(steps)
    # a profile's error on logs, nothing fitted: the fitted one on its own steps
    capsys.readouterr()
    assert main(["profile", "device", "--base", str(fitted_path), "--check", str(log)]) == 0
    assert "the base's error on the --check steps" in capsys.readouterr().out


def write_log(path, steps) -> None:
    keys = ("chunks", "decodes", "pad", "sampled", "neighbours", "swapped", "t")
    path.write_text("".join(json.dumps({**{k: getattr(s, k) for k in keys}, "forward_s": s.seconds, "busy_s": s.seconds,
                                        "cpu_s": s.seconds, "system": "a"}) + "\n" for s in steps))


def test_speed_only_reads_the_machines_speed_off_decode_steps(tmp_path, capsys):
    """A run in slow minutes: every step 25% over the profile. One number is fitted; with
    ``--speed-on decode`` it is read off the decode-only steps, so prompt steps off by something
    else (a policy's mix) do not move it."""
    from dataclasses import replace

    from aserve.commands import EXIT_USAGE, main

    steps = synthetic_steps(scaled(TRUE, 1.25), 900, noise=0.03)
    assert speed(TRUE, steps, "decode") == pytest.approx(1.25, rel=0.01)
    odd = [s if s.kind == "decode" else replace(s, seconds=2 * s.seconds) for s in steps]
    assert speed(TRUE, odd, "decode") == pytest.approx(1.25, rel=0.01)
    log, base, out = tmp_path / "steps.jsonl", tmp_path / "base.json", tmp_path / "fast.json"
    write_log(log, steps)
    TRUE.save(base)
    assert main(["profile", "device", "--from-steps", str(log), "--base", str(base), "--out", str(out),
                 "--speed-only", "--speed-on", "decode"]) == 0
    assert "every cost x1.2" in capsys.readouterr().out
    got = CostModel.load(out)
    f = got.meta["calibrated"]["speed"]
    assert f == pytest.approx(1.25, rel=0.01) and "ridge" not in got.meta["calibrated"]
    assert got.linear_s == pytest.approx([f * y for y in TRUE.linear_s])
    assert (got.attn_prefill_s, got.attn_decode_s, got.logits_row_s, got.contention) == pytest.approx(
        (f * TRUE.attn_prefill_s, f * TRUE.attn_decode_s, f * TRUE.logits_row_s, TRUE.contention))
    assert abs(got.meta["calibrated"]["fitted"]["after"]["all"]["total"]) < 0.01
    write_log(log, [s for s in steps if s.kind != "decode"])
    assert main(["profile", "device", "--from-steps", str(log), "--base", str(base), "--out", str(out),
                 "--speed-only", "--speed-on", "decode"]) == EXIT_USAGE
    assert "no usable decode-only step" in capsys.readouterr().err


def test_speed_on_all_steps_is_the_runs_busy_time(tmp_path, capsys):
    """``--speed-on all`` (the default): summed measured over summed predicted time of every step,
    so the scaled profile's busy time is the run's, prompt steps included (the decode median
    ignores them)."""
    from dataclasses import replace

    from aserve.commands import EXIT_USAGE, main

    steps = synthetic_steps(scaled(TRUE, 1.25), 900, noise=0.03)
    assert speed(TRUE, steps) == speed(TRUE, steps, "all") == pytest.approx(1.25, rel=0.01)
    odd = [s if s.kind == "decode" else replace(s, seconds=2 * s.seconds) for s in steps]
    f = speed(TRUE, odd, "all")
    assert f > 1.3 and sum(s.seconds for s in odd) == pytest.approx(sum(predict(scaled(TRUE, f), s) for s in odd))
    with pytest.raises(ValueError, match="bad speed statistic 'mean'"):
        speed(TRUE, steps, "mean")
    log, base, out = tmp_path / "steps.jsonl", tmp_path / "base.json", tmp_path / "fast.json"
    write_log(log, odd)
    TRUE.save(base)
    assert main(["profile", "device", "--from-steps", str(log), "--base", str(base), "--out", str(out),
                 "--speed-only"]) == 0
    got = CostModel.load(out).meta["calibrated"]
    assert got["speed_on"] == "all" and got["speed"] == pytest.approx(f)
    assert abs(got["fitted"]["after"]["all"]["total"]) < 1e-9
    out_text = capsys.readouterr().out
    assert "every cost x" in out_text and "linear table" not in out_text and "speed trace" not in out_text
    assert main(["profile", "device", "--from-steps", str(log), "--base", str(base), "--out", str(out),
                 "--speed-on", "decode"]) == EXIT_USAGE
    assert "give --speed-only too" in capsys.readouterr().err


def test_speed_window_traces_the_runs_minutes(tmp_path, capsys):
    """``--speed-window S``: per S seconds of one run (by when its steps started), measured over
    predicted time against the profile at the run's speed. A run 20% slow in its first minute,
    idle in its second, 10% fast in its third, with 5 steps (too few) in its fourth: the trace is
    1.2/F, 1.0, 0.9/F, 1.0 for the run's one speed F; it lands in the written profile; one run's
    steps only, and only with --speed-only."""
    from dataclasses import replace

    from aserve.commands import EXIT_USAGE, main

    def minute(k: int, n: int, slow: float, seed: int) -> list[LoggedStep]:
        return [replace(s, seconds=slow * s.seconds, t=60 * k + 60 * i / n)
                for i, s in enumerate(synthetic_steps(TRUE, n, noise=0.0, seed=seed))]

    steps = minute(0, 200, 1.2, 0) + minute(2, 200, 0.9, 1) + minute(3, 5, 2.0, 2)
    f = speed(TRUE, steps)
    trace = speed_trace(scaled(TRUE, f), steps, 60)
    assert [t for t, _ in trace] == [0, 60, 120, 180]
    assert [x for _, x in trace] == pytest.approx([1.2 / f, 1.0, 0.9 / f, 1.0])
    with pytest.raises(ValueError, match="speed window must be > 0"):
        speed_trace(TRUE, steps, 0)
    log, base, out = tmp_path / "steps.jsonl", tmp_path / "base.json", tmp_path / "traced.json"
    write_log(log, steps)
    TRUE.save(base)
    args = ["profile", "device", "--from-steps", str(log), "--base", str(base), "--out", str(out)]
    assert main([*args, "--speed-only", "--speed-window", "60"]) == 0
    out_text = capsys.readouterr().out
    assert "speed trace: 4 windows of 60 s" in out_text and "linear table" not in out_text  # nothing fitted
    got = CostModel.load(out)
    assert [t for t, _ in got.speed_trace] == [t for t, _ in trace]
    assert [x for _, x in got.speed_trace] == pytest.approx([x for _, x in trace])
    assert got.meta["calibrated"]["speed_window"] == 60
    assert got.linear_s == pytest.approx(scaled(TRUE, f).linear_s)
    for argv, why in ((["--speed-window", "60"], "give --speed-only too"),
                      (["--speed-only", "--speed-window", "0"], "speed window must be > 0"),
                      (["--speed-only", "--speed-window", "60", "--from-steps", str(log), str(log)], "give one step log")):
        assert main([*args, *argv]) == EXIT_USAGE
        assert why in capsys.readouterr().err


def test_scale_writes_the_base_at_another_speed(tmp_path, capsys):
    """``--scale F``: the base with every cost times F, no steps read (a speed sweep's profiles);
    the base's meta kept, the factor recorded; bad factors and flags named."""
    from aserve.commands import EXIT_USAGE, main

    base, out = tmp_path / "base.json", tmp_path / "slow.json"
    TRUE.save(base)
    assert main(["profile", "device", "--base", str(base), "--scale", "1.05", "--out", str(out)]) == 0
    assert "every cost x1.05" in capsys.readouterr().out
    got = CostModel.load(out)
    assert got.linear_s == pytest.approx([1.05 * y for y in TRUE.linear_s])
    assert (got.attn_prefill_s, got.attn_decode_s, got.logits_row_s, got.contention) == pytest.approx(
        (1.05 * TRUE.attn_prefill_s, 1.05 * TRUE.attn_decode_s, 1.05 * TRUE.logits_row_s, TRUE.contention))
    assert got.meta["scaled"]["by"] == 1.05
    step = synthetic_steps(TRUE, 1, noise=0.0)[0]
    assert predict(got, step) == pytest.approx(1.05 * predict(TRUE, step))
    for argv, why in ((["--scale", "0", "--out", str(out)], "--scale must be > 0"),
                      (["--scale", "-1", "--out", str(out)], "--scale must be > 0"),
                      (["--scale", "1.1", "--speed-only", "--out", str(out)], "--scale takes no steps"),
                      (["--scale", "1.1"], "--scale needs --out")):
        assert main(["profile", "device", "--base", str(base), *argv]) == EXIT_USAGE
        assert why in capsys.readouterr().err
    assert main(["profile", "device", "--scale", "1.1", "--out", str(out)]) == EXIT_USAGE
    assert "need --base" in capsys.readouterr().err


def test_bad_step_logs_and_flags_name_the_problem(tmp_path, capsys):
    from aserve.commands import EXIT_USAGE, main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"chunks": [[4, 0]], "decodes": []}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a step-log line"):
        read_steps([bad])
    with pytest.raises(ValueError, match="bad step-log target"):
        read_steps([bad], target="wall")
    TRUE.save(tmp_path / "base.json")
    assert main(["profile", "device", "--from-steps", str(bad), "--base", str(tmp_path / "base.json")]) == EXIT_USAGE
    assert "--from-steps needs --out" in capsys.readouterr().err
    assert main(["profile", "device", "--from-steps", str(bad), "--out", str(tmp_path / "x.json")]) == EXIT_USAGE
    assert "need --base" in capsys.readouterr().err
    assert main(["profile", "device", "--base", "local", "--check", str(bad)]) == EXIT_USAGE
    assert "--base local needs --threads" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no usable steps"):
        fit(TRUE, [LoggedStep((), (), 0, 0, 0.01, 0)])


def test_the_step_log_counts_neighbours_stepping_and_their_overlap(tmp_path):
    """Two instances on a fake clock: a steps 0..2, b 1..4, then a 5..6 alone."""
    from aserve.engine.step_log import StepLog
    from scheduling.step import GREEDY, SeqStep, StepOutput, StepPlan

    now = [0.0]
    log = StepLog(tmp_path / "s.jsonl")
    log.start_system("sys", lambda: now[0])
    plan = StepPlan((SeqStep("c", tuple(range(8)), 16, (0, 1)), SeqStep("d", (5,), 40, (2, 3, 4), GREEDY)),
                    num_pad_tokens=2)

    def at(t):
        now[0] = t

    a = log.begin("a")
    at(1.0)
    b = log.begin("b")
    at(2.0)
    log.end("a", "coupled", plan, StepOutput({}, forward_s=1.9, busy_s=2.0), 1.8, a)
    at(4.0)
    log.end("b", "coupled", plan, StepOutput({}, forward_s=2.9, busy_s=3.0), 2.5, b)
    at(5.0)
    c = log.begin("a")
    at(6.0)
    log.end("a", "coupled", plan, None, 0.0, c)  # raised: no line
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [(x["instance"], x["neighbours"], x["overlap"], x["t"]) for x in lines] == [("a", 0, 0.5, 0.0),
                                                                                         ("b", 1, round(1 / 3, 4), 1.0)]
    assert lines[0]["chunks"] == [[8, 16]] and lines[0]["decodes"] == [41] and lines[0]["pad"] == 2
    assert lines[0]["sampled"] == 1 and lines[1]["cpu_s"] == 2.5 and log.num_lines == 2
    (step,) = [s for s in read_steps([tmp_path / "s.jsonl"], "busy_s") if s.neighbours]
    assert step.seconds == 3.0 and step.kind == "mixed" and step.rows == 11
