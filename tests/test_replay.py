"""Replay and report: a small in-process --compare replay end to end, plus the pieces without a model."""
from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from aserve.commands import build_parser
from aserve.replay.driver import drive
from aserve.commands.replay import parse_compare
from aserve.replay.report import LATENCIES, RequestRecord, SystemRun, build_report, print_report, summarize
from aserve.replay.slo import build_slo
from aserve.replay.traces import Trace, TraceRequest
from tests.step_log_support import check_step_log

TRACE = [  # 6 requests, short outputs; one with prompt text, one long enough for several chunks
    {"timestamp": 0.0, "prompt_tokens": 40, "output_tokens": 6},
    {"timestamp": 0.1, "prompt_tokens": 300, "output_tokens": 8},
    {"timestamp": 0.2, "prompt_tokens": 20, "output_tokens": 8},
    {"timestamp": 0.3, "prompt": "Tell me a story about a dragon.", "output_tokens": 5},
    {"timestamp": 0.4, "prompt_tokens": 150, "output_tokens": 1},
    {"timestamp": 0.5, "prompt_tokens": 64, "output_tokens": 8},
]
SYSTEM_KEYS = {"completed", "failed", "aborted", "clipped", *LATENCIES, "throughput_rps", "output_tokens_per_s",
               "request_goodput", "slo_attainment", "goodput_per_device", "resource_usage_s", "perf_per_dollar_vs_first", "stalls", "padding_tokens",
               "kv_bytes_moved", "kv_transfers", "kv_real_s", "kv_emulated_s", "kv_real_bytes_per_s", "flips",
               "instance_failures", "recovery_s_max"}


def parser() -> argparse.ArgumentParser:
    return build_parser()


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    trace = tmp / "tiny.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}: why is the sky blue?"}) + "\n" for i in range(5)))
    args = parser().parse_args([
        "replay", str(trace), "--prompts", str(prompts), "--max-output-tokens", "7",
        "--compare", "tetri: --mode disagg --prefill 1 --decode 1 --pad ; vllm: --mode coupled --instances 2 --batching vllm",
        "--kv-cache-gb", "0.05", "--chunk-size", "128", "--max-num-batched-tokens", "512", "--json", str(tmp / "out.json"),
        "--plots", str(tmp / "plots"), "--step-log", str(tmp / "steps.jsonl"), "--predictor", "oracle",
        "--slo", "ttft=30,tbt=5", "--no-progress"])
    rc = args.func(args)
    return rc, json.loads((tmp / "out.json").read_text()), tmp


@pytest.mark.slow
def test_compare_replay_completes_every_request(replayed):
    rc, report, _ = replayed
    assert rc == 0
    assert list(report["systems"]) == ["tetri", "vllm"]
    assert report["trace"]["num_requests"] == 6 and report["trace"]["num_clipped"] == 3
    assert any("--max-output-tokens 7: 3 requests" in c for c in report["trace"]["changes"])
    for s in report["systems"].values():
        assert (s["completed"], s["failed"], s["aborted"], s["clipped"]) == (6, 0, 0, 3)
        assert s["output_tokens"] == 6 + 7 + 7 + 5 + 1 + 7  # exactly the fitted lengths


@pytest.mark.slow
def test_report_shape_and_sane_numbers(replayed):
    _, report, _ = replayed
    assert set(report) == {"trace", "systems"}
    for name, s in report["systems"].items():
        assert SYSTEM_KEYS <= set(s), SYSTEM_KEYS - set(s)
        for key in ("ttft", "tpot", "token_gap", "jct", "normalized_latency"):
            assert set(s[key]) == {"mean", "p50", "p90", "p99", "p999", "max"}
            assert s[key]["p50"] <= s[key]["p99"] <= s[key]["p999"] <= s[key]["max"]
        assert 0 < s["ttft"]["mean"] <= s["jct"]["mean"] and s["ttft"]["p99"] <= s["jct"]["p99"]
        assert s["throughput_rps"] > 0 and s["output_tokens_per_s"] > 0 and s["resource_usage_s"] > 0
        assert 0 <= s["request_goodput"] <= s["throughput_rps"] and 0 <= s["slo_attainment"] <= 1
        assert s["devices"] == 2 and s["goodput_per_device"] == pytest.approx(s["request_goodput"] / 2)
        assert s["flips"] == 0 and s["stalls"]["count"] >= 0
        # the oracle, asked for: replay hands it every request's true length (and the header names it)
        assert s["predictor_label"] == "oracle"
        pred = s["predictor"]
        assert pred["name"] == "oracle" and (pred["predictions"], pred["fallbacks"], pred["scored"]) == (6, 0, 6)
        assert (pred["features"], pred["from_prefill"]) == ("prompt", 0)  # the oracle reads no model state
        assert s["predictor_accuracy"] == 1.0
    tetri, vllm = report["systems"]["tetri"], report["systems"]["vllm"]
    assert tetri["perf_per_dollar_vs_first"] == 1.0 and vllm["perf_per_dollar_vs_first"] > 0
    assert tetri["kv_bytes_moved"] > 0 and vllm["kv_bytes_moved"] == 0  # only disagg hands KV over
    # five hand-overs: the 1-token request ends at its prefill; both times on record, the real within the emulated
    assert tetri["kv_transfers"] == 5 and 0 < tetri["kv_real_s"] <= tetri["kv_emulated_s"]
    assert tetri["kv_real_bytes_per_s"] > 0 and vllm["kv_real_s"] is None
    assert (tetri["instance_failures"], tetri["recovery_s_max"], tetri["failures"]) == (0, None, [])
    assert tetri["padding_tokens"] > 0 and vllm["padding_tokens"] == 0
    assert tetri["queue_time"] is not None  # prefill instances stamp "scheduled"


@pytest.mark.slow
def test_the_step_log_has_every_step_timed(replayed):
    """One line per step of each system after the warm-up (the sums agree with the report), each
    timed on the real device: the forward within the time the step held the instance."""
    _, report, tmp = replayed
    lines = [json.loads(x) for x in (tmp / "steps.jsonl").read_text().splitlines()]
    for name, system in report["systems"].items():
        check_step_log(lines, name, system)
    for x in lines:
        assert 0 < x["forward_s"] <= x["busy_s"] and x["cpu_s"] > 0 and 0 <= x["overlap"]
        assert x["sampled"] <= len(x["decodes"]) + len(x["chunks"])


@pytest.mark.slow
def test_blocks_return_and_plots_written(replayed):
    _, report, tmp = replayed
    for s in report["systems"].values():
        assert {i["role"] for i in s["instances"]} <= {"prefill", "decode", "coupled"}
        for inst in s["instances"]:
            assert inst["free_blocks_end"] == inst["free_blocks_start"], inst
    for name in ("cdf.png", "timeline.png", "relative.png", "slo.png"):
        assert (tmp / "plots" / name).stat().st_size > 10_000


# ---- without a model ------------------------------------------------------------------------------
def test_compare_parsing_layers_over_the_command_line():
    base = parser().parse_args(["replay", "t.jsonl", "--kv-cache-gb", "0.1", "--chunk-size", "256"])
    a, b = parse_compare("a: --mode disagg --decode 2 ; b: --mode coupled --batching vllm --chunk-size 64", base)
    assert (a.name, a.cluster.num_decode, a.cluster.chunk_size, a.engine.kv_cache_gb) == ("a", 2, 256, 0.1)
    assert (b.cluster.mode, b.engine.batching, b.cluster.chunk_size) == ("coupled", "vllm", 64)
    for bad, match in (("x: --dtype fp32", "cannot differ"), ("x: --bogus 1", "unknown flags"), ("--mode disagg", "NAME"),
                       ("x: --decode two", "decode"), ("x: ; x: --mode coupled", "distinct")):
        with pytest.raises(ValueError, match=match):
            parse_compare(bad, base)


def record(i, arrival, times, status="completed", error=None):
    return RequestRecord(i, 10, len(times), arrival, status, arrival + 0.01, times[0] if times else None,
                         times[-1] if times else None, tuple(times), error=error)


def test_summarize_hand_made_records():
    recs = (record(0, 0.0, [0.5, 0.6, 0.7, 0.8]), record(1, 1.0, [1.2, 1.3, 2.3]), record(2, 1.5, [], "failed"))
    s = summarize(SystemRun("x", recs), build_slo("ttft=0.3", None))
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["ttft"]["mean"] == pytest.approx(0.35) and s["jct"]["p50"] == pytest.approx(1.05)
    assert s["stalls"]["count"] == 1 and s["stalls"]["seconds"] == pytest.approx(1.0)  # the 1.0 s gap > 5 x 0.1
    assert s["throughput_rps"] == pytest.approx(2 / 2.3) and s["request_goodput"] == pytest.approx(1 / 2.3)
    # the failed request counts against attainment; devices unknown (no instances): no per-device figure
    assert s["slo_attainment"] == pytest.approx(1 / 3) and s["slo_misses"] == {"ttft": 1, "failed": 1}
    assert s["goodput_per_device"] is None
    # TPOT per request (0.1, 0.55) and the gaps themselves, named apart: the 1.0 s gap is the max
    assert s["tpot"]["mean"] == pytest.approx(0.325) and s["token_gap"]["max"] == pytest.approx(1.0)
    assert s["token_gap"]["p50"] == pytest.approx(0.1)
    report = build_report({"source": "t"}, [SystemRun("x", recs), SystemRun("y", recs)])
    assert report["systems"]["y"]["resource_usage_s"] is None  # no instances (e.g. over HTTP)


def test_report_says_why_requests_failed():
    """A failed request is a count in the table and its reason beneath it (the replay exits 1 on
    failures, so the reason must be there to read), commonest first, markup in it left as text."""
    from rich.console import Console

    too_long = "prompt plus max_tokens needs 140 KV blocks; the largest instance has 128 [sic]"
    recs = (record(0, 0.0, [0.5, 0.6]), record(1, 0.1, [], "failed", error=too_long),
            record(2, 0.2, [], "failed", error="HTTP 400: bad"), record(3, 0.3, [], "failed", error=too_long),
            record(4, 0.4, [], "failed"))
    s = summarize(SystemRun("x", recs))
    assert s["failed"] == 4
    assert list(s["errors"].items()) == [(too_long, 2), ("HTTP 400: bad", 1), ("no reason recorded", 1)]
    assert summarize(SystemRun("ok", recs[:1]))["errors"] == {}
    console = Console(record=True, width=200)
    print_report(build_report({"source": "t"}, [SystemRun("x", recs)]), console)
    out = console.export_text()
    assert f"x: 2 failed: {too_long}" in out and "x: 1 failed: HTTP 400: bad" in out


def test_oracle_gain_kept_is_the_share_of_the_oracles_improvement():
    from aserve.replay.report import add_oracle_gain_kept

    def system(predictor, norm, jct):
        return {"predictor": predictor and {"name": predictor}, "normalized_latency": {"mean": norm},
                "jct": {"mean": jct}}

    systems = {"vllm": system(None, 0.05, 12.0), "none": system("none", 0.04, 10.0),
               "oracle": system("oracle", 0.03, 8.0), "sk": system("sklearn", 0.035, 10.5),
               "lm": system("lm", 0.045, 9.0)}
    add_oracle_gain_kept(systems)
    assert systems["sk"]["oracle_gain_kept"] == pytest.approx({"normalized_latency": 0.5, "jct": -0.25})
    assert systems["lm"]["oracle_gain_kept"] == pytest.approx({"normalized_latency": -0.5, "jct": 0.5})
    assert systems["oracle"]["oracle_gain_kept"] == pytest.approx({"normalized_latency": 1.0, "jct": 1.0})
    assert "oracle_gain_kept" not in systems["vllm"] and "oracle_gain_kept" not in systems["none"]
    systems["oracle"]["jct"]["mean"] = 11.0  # the oracle lost on JCT: no gain to share
    add_oracle_gain_kept(systems)
    assert systems["sk"]["oracle_gain_kept"]["jct"] is None
    del systems["oracle"], systems["sk"]["oracle_gain_kept"]
    add_oracle_gain_kept(systems)  # without an oracle run there is nothing to measure against
    assert "oracle_gain_kept" not in systems["sk"]


def test_drive_respects_arrivals_and_timeout():
    trace = Trace(tuple(TraceRequest(t, 5, 2) for t in (0.0, 0.05, 0.1, 5.0)), "t", "test")
    started = []

    async def send(i):
        loop = asyncio.get_running_loop()
        started.append(loop.time())
        try:
            await asyncio.sleep(0.05 if i < 2 else 10)
            return RequestRecord(i, 5, 2, 0.0, "completed")
        except asyncio.CancelledError:
            return RequestRecord(i, 5, 2, 0.0, "aborted")

    records = asyncio.run(drive(trace, send, timeout_s=0.5))
    assert [r.status for r in records] == ["completed", "completed", "aborted", "aborted"]
    assert len(started) == 3 and started[2] - started[0] == pytest.approx(0.1, abs=0.05)
    assert "not sent" in records[3].error


def test_replayed_requests_do_not_carry_their_true_length_as_max_tokens():
    """Policies and predictors read max_tokens; a replay must not hand them the answer."""
    from aserve.engine.stops import StopChecker
    from aserve.replay.driver import replay_cap, sampling_for
    from scheduling.request import Request, SamplingParams

    sp = sampling_for(TraceRequest(0.0, 10, 37), replay_cap(500, 8192, 10))
    assert (sp.max_tokens, sp.length_after, sp.ignore_eos) == (500, 37, True)
    assert replay_cap(500, 300, 100) == 200  # never past the context window
    assert sampling_for(TraceRequest(0.0, 10, 37)).max_tokens == 37  # no cap given: the length itself
    stops = StopChecker(tokenizer=None, eos_token_ids=(2,))
    req = Request("r", [5, 6], sp)
    for n in range(37):
        req.output_token_ids.append(2)  # EOS is ignored
        assert stops.check(req) == ("length" if n == 36 else None)
    with pytest.raises(ValueError, match="length_after"):
        SamplingParams(max_tokens=5, length_after=6)


def test_chat_replay_refuses_flags_that_would_cut_its_text(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0.0, "prompt": "Why is the sky blue?", "output_tokens": 4}) + "\n")
    for extra in (["--max-prompt-tokens", "10"], ["--prompts", str(trace)], ["--length-scale", "2"]):
        args = parser().parse_args(["replay", str(trace), "--chat", "--no-progress", *extra])
        with pytest.raises(ValueError, match="--chat sends each request's own text whole"):
            args.func(args)
