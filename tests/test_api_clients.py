"""What the ecosystem's clients really send, replayed against the real server.

tests/data/clients/<client>.json holds request bodies recorded from the clients themselves
(tests/clients/recorder.py; each file names the client, its version and the command). Every
body gets a 200 and an answer of the right shape; only ``max_tokens`` is cut to keep the test
fast. Fields that are truly unsupported still get a 400 that names them.
"""
import json
from pathlib import Path

import pytest

from tests.api_support import coupled_server as server, sse_events  # noqa: F401

pytestmark = pytest.mark.slow
CLIENTS = Path(__file__).parent / "data" / "clients"
MAX_TOKENS = 6
GENERATION = ("/v1/completions", "/v1/chat/completions")
# vllm bench serve also posts to vLLM's own /tokenize (it carries on without it): not replayed here
RECORDED = [(f.stem, i, r) for f in sorted(CLIENTS.glob("*.json"))
            for i, r in enumerate(json.loads(f.read_text())["requests"]) if r["path"] in GENERATION]


def short(body: dict) -> dict:
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None:
            body[key] = min(body[key], MAX_TOKENS)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    return body


def num_choices(body: dict) -> int:
    prompt = body.get("prompt")
    batch = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    return (body.get("n") or 1) * batch


def check_stream(events: list, chat: bool, body: dict) -> None:
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    options = body.get("stream_options") or {}
    if options.get("include_usage"):
        last = chunks.pop()
        assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
        continuous = options.get("continuous_usage_stats")
        assert all((c["usage"] is not None) == bool(continuous) for c in chunks)
    obj = "chat.completion.chunk" if chat else "text_completion"
    assert all(c["object"] == obj and len(c["choices"]) == 1 for c in chunks)
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == list(range(num_choices(body)))  # one finish per choice
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert any(c["choices"][0]["delta"].get("content") for c in chunks)
    else:
        assert any(c["choices"][0]["text"] for c in chunks)


@pytest.mark.parametrize("client,i,recorded", RECORDED, ids=[f"{c}-{i}" for c, i, _ in RECORDED])
def test_recorded_body_is_served(server, client, i, recorded):
    body = short(recorded["body"])
    chat = recorded["path"].endswith("/chat/completions")
    status, headers, raw = server.request("POST", recorded["path"], body)
    assert status == 200, raw[:500]
    if body.get("stream"):
        assert headers["Content-Type"].startswith("text/event-stream")
        check_stream(sse_events(raw), chat, body)
    else:
        out = json.loads(raw)
        assert out["object"] == ("chat.completion" if chat else "text_completion")
        assert [c["index"] for c in out["choices"]] == list(range(num_choices(body)))
        assert out["usage"]["completion_tokens"] >= 1


def test_every_client_is_recorded():
    names = {f.stem for f in CLIENTS.glob("*.json")}
    assert names >= {"openai", "langchain", "guidellm", "aiperf", "vllm-bench-serve"}, names
    for f in CLIENTS.glob("*.json"):
        rec = json.loads(f.read_text())
        assert rec["client"] == f.stem and rec["version"] and rec["requests"], f


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"stream": True, "stream_options": {"include_usage": True, "unknown_option": True}}, "stream_options"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_unsupported_fields_are_refused_by_name(server, extra, param):
    chat = next(r for c, _, r in RECORDED if c == "guidellm")
    status, _, raw = server.request("POST", chat["path"], {**short(chat["body"]), **extra})
    assert status == 400
    err = json.loads(raw)["error"]
    assert err["param"] == param, err
