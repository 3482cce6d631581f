"""The HTTP replay client against a fake OpenAI-compatible server that streams token chunks."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer as FakeServer

from aserve.replay.http_target import api_base, replay_http
from aserve.replay.report import summarize
from aserve.replay.traces import Trace, TraceRequest

SEEN: list[dict] = []


def chunk(text, finish=None) -> bytes:
    obj = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": None}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    SEEN.append(body)
    if body["prompt"][0] == 999:
        return web.json_response({"error": {"message": "prompt too long"}}, status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = body["max_tokens"]
    for i in range(n):
        await asyncio.sleep(0.01)
        held_back = body["prompt"][0] == 7 and i == 1  # a token whose text the server holds back
        if not held_back:
            await resp.write(chunk("tok" if i != 2 or body["prompt"][0] != 7 else "toktok"))
    await resp.write(chunk("", "length"))
    await resp.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


async def run_against_fake(trace: Trace, prompts):
    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    server = FakeServer(app)
    await server.start_server()
    try:
        return await replay_http(str(server.make_url("/v1")), "fake", trace, prompts)
    finally:
        await server.close()


def test_http_replay_streams_and_times_tokens():
    SEEN.clear()
    trace = Trace((TraceRequest(0.0, 3, 4), TraceRequest(0.05, 2, 5), TraceRequest(0.1, 2, 3)), "t", "test")
    run = asyncio.run(run_against_fake(trace, [[5, 6, 7], [7, 8], [999, 1]]))
    ok, held, bad = run.records
    assert (ok.status, ok.output_tokens, len(ok.token_times)) == ("completed", 4, 4)
    assert ok.first_token_s - ok.arrival_s >= 0.009 and ok.finish_s >= ok.first_token_s
    assert (held.status, held.output_tokens, len(held.token_times)) == ("completed", 5, 4)  # usage wins
    assert bad.status == "failed" and "HTTP 400" in bad.error
    body = SEEN[0]
    assert body["model"] == "fake-model" and body["prompt"] == [5, 6, 7] and body["ignore_eos"] is True
    assert body["max_tokens"] == 4 and body["temperature"] == 0 and body["stream"] is True
    s = summarize(run)
    assert (s["completed"], s["failed"]) == (2, 1) and s["resource_usage_s"] is None
    # beside aserve's own keys, vllm bench serve's (aserve/replay/vllm_names.py)
    assert {f"{st}_{m}_ms" for st in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")} <= set(s)
    assert s["total_output_tokens"] == 9 and s["request_throughput"] == pytest.approx(2 / s["duration"])
    assert s["mean_ttft_ms"] == pytest.approx(1000 * (ok.first_token_s - ok.arrival_s + held.first_token_s
                                                      - held.arrival_s) / 2)
    # under --goodput: the failed request is not good; a server that is not aserve has no devices to
    # count (goodput per device needs --devices), and a fake has no predictor to name
    from dataclasses import replace

    from aserve.replay.slo import build_slo

    slo = build_slo(None, ["ttft:5000", "token_gap:5000"])
    s = summarize(run, slo)
    assert s["slo_attainment"] == pytest.approx(2 / 3) and s["slo_misses"] == {"ttft": 0, "token_gap": 0, "failed": 1}
    assert s["goodput_per_device"] is None and s["predictor_label"] == "predictor n/a"
    two = summarize(replace(run, devices=2), slo)
    assert two["devices"] == 2 and two["goodput_per_device"] == pytest.approx(two["request_goodput"] / 2)


def test_vllm_fields_by_hand():
    """Two requests with known times: every vLLM statistic by its definition (ms, population std)."""
    from aserve.replay.report import RequestRecord
    from aserve.replay.vllm_names import vllm_fields

    a = RequestRecord(0, 10, 3, 0.0, "completed", first_token_s=0.1, finish_s=0.5, token_times=(0.1, 0.2, 0.5))
    b = RequestRecord(1, 20, 2, 1.0, "completed", first_token_s=1.3, finish_s=1.4, token_times=(1.3, 1.4))
    c = RequestRecord(2, 5, 2, 1.2, "failed", error="boom")
    f = vllm_fields([a, b, c])
    assert (f["completed"], f["failed"], f["total_input_tokens"], f["total_output_tokens"]) == (2, 1, 30, 5)
    assert f["duration"] == pytest.approx(1.4)
    assert f["request_throughput"] == pytest.approx(2 / 1.4) and f["output_throughput"] == pytest.approx(5 / 1.4)
    assert (f["mean_ttft_ms"], f["median_ttft_ms"], f["std_ttft_ms"]) == pytest.approx((200, 200, 100))
    assert f["mean_tpot_ms"] == pytest.approx((200 + 100) / 2)  # a: (0.5 - 0.1) / 2, b: 0.1 / 1
    assert f["median_itl_ms"] == pytest.approx(100) and f["p99_itl_ms"] == pytest.approx(100 + 200 * 0.98)
    assert f["mean_e2el_ms"] == pytest.approx((500 + 400) / 2)


def test_api_base():
    assert api_base("http://h:1/v1/") == api_base("http://h:1") == "http://h:1"
    with pytest.raises(ValueError, match="--url"):
        api_base("h:1")


@pytest.mark.slow
def test_http_replay_against_the_aserve_server():
    """The real server (tests/api_support.py): exact output lengths, and its /v1/stats internals."""
    api_support = pytest.importorskip("api_support", reason="tests/api_support.py (the aserve server harness) is absent")
    from aserve.config import ClusterConfig
    from aserve.replay.workloads import PromptBuilder

    trace = Trace(tuple(TraceRequest(0.1 * i, 20 + 40 * i, 5) for i in range(4)), "t", "test")
    with api_support.ServerThread(ClusterConfig(mode="disagg")) as server:
        prompts = PromptBuilder(api_support.bundle().tokenizer).build(trace.requests)
        run = asyncio.run(replay_http(server.url, "aserve", trace, prompts))
    assert [(r.status, r.output_tokens) for r in run.records] == [("completed", 5)] * 4
    assert {i.role for i in run.instances} == {"prefill", "decode"}
    assert all(i.free_blocks_end == i.free_blocks_start for i in run.instances)
    s = summarize(run)
    assert s["resource_usage_s"] > 0 and s["kv_bytes_moved"] > 0 and s["ttft"]["mean"] <= s["jct"]["mean"]
    assert run.num_devices == 2 and run.predictor["name"] == "oracle"  # from the server's /v1/stats
