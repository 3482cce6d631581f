"""The API through the real ``openai`` client: chat and completions, streaming and not, usage."""
import json

import openai
import pytest

from aserve.config import ClusterConfig
from tests.api_support import ServerThread, bundle

pytestmark = pytest.mark.slow
# fp32 has a near-tie at the bare question's first token (see test_default_model.DECISIVE_QUESTION)
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]


@pytest.fixture(scope="module")
def server():
    with ServerThread(ClusterConfig(mode="coupled", num_coupled=1)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _stream_chat(client, **kw):
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, "usage chunk comes last"
    assert all(c.usage is None for c in chunks[:-1])
    return text, reasons, chunks[-1].usage


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == ["smollm2-135m-instruct"]
    status, _, body = server.request("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "default"])
def test_chat_streamed_equals_unstreamed(client, model):
    kw = dict(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens == len(bundle().encode(QUESTION))
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    text, reasons, usage = _stream_chat(client, **kw)
    assert text == choice.message.content
    assert reasons == [choice.finish_reason]
    assert usage.model_dump() == full.usage.model_dump()


def test_chat_role_chunk_comes_with_the_first_token_not_before_the_prefill(client):
    """Clients that time the first chunk as TTFT (vllm bench serve) must not read the time to the
    response headers: the role chunk comes with the first token, as vLLM sends it. A prompt of
    ~1,500 tokens takes a visible prefill; the role chunk must not arrive well before the token."""
    import time

    long = [{"role": "user", "content": "Count the words in this text. " + "one two three four five " * 300}]
    t0 = time.perf_counter()
    arrivals = [(time.perf_counter() - t0, c) for c in client.chat.completions.create(
        model="default", messages=long, max_tokens=4, temperature=0, stream=True)]
    (t_role, role), (t_token, _) = arrivals[0], arrivals[1]  # the next chunk: a token, or the end
    assert role.choices[0].delta.role == "assistant"
    assert t_token > 0.2, f"the prefill took {t_token:.3f} s: too short to tell the chunks apart"
    assert t_role > 0.8 * t_token, (t_role, t_token)


def test_completion_streamed_equals_unstreamed(client):
    kw = dict(model="default", prompt="The capital of France is", max_tokens=12, temperature=0, ignore_eos=True)
    full = client.completions.create(extra_body={"ignore_eos": True},
                                     **{k: v for k, v in kw.items() if k != "ignore_eos"})
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    chunks = list(client.completions.create(stream=True, extra_body={"ignore_eos": True},
                                            **{k: v for k, v in kw.items() if k != "ignore_eos"}))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "Paris" in full.choices[0].text


@pytest.mark.parametrize("stop", ["\n", ["aris", "zzz"]])
def test_stop_strings_cut_the_text(client, stop):
    kw = dict(model="default", prompt="The capital of France is", max_tokens=12, temperature=0, stop=stop)
    full = client.completions.create(**kw)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "stop"
    for s in [stop] if isinstance(stop, str) else stop:
        assert s not in text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == text


def test_seeded_sampling_repeats(client):
    kw = dict(model="default", messages=QUESTION, max_tokens=8, temperature=0.9, top_p=0.95, seed=7)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_token_id_prompt(client):
    ids = bundle().tokenizer.encode("The capital of France is")
    by_ids = client.completions.create(model="default", prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(model="default", prompt="The capital of France is", max_tokens=4,
                                        temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_metrics_and_stats_report_the_requests(server, client):
    client.completions.create(model="default", prompt="Hello", max_tokens=3, temperature=0)
    status, headers, body = server.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:num_requests_running{",
                 "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{", "vllm:num_preemptions_total{",
                 "vllm:prompt_tokens_total{", "vllm:generation_tokens_total{", "aserve:pad_tokens_total{",
                 "aserve:instance_busy_seconds_total{", "aserve:loop_lag_seconds", "aserve:flips_total 0.0",
                 'aserve:requests_total{outcome="finished"}', "aserve:kv_transfer_timeouts_total 0.0",
                 "aserve:kv_transfer_retries_total 0.0", "aserve:kv_transfer_recomputes_total 0.0",
                 "aserve:prefill_leases_expired_total 0.0", "aserve:instance_failures_total 0.0"):
        assert name in text, name
    assert 'outcome="transfer_retries"' not in text  # each control-plane counter has its own family
    assert 'instance="c0"' in text
    snap = server.wait_idle()
    (inst,) = snap["instances"]
    assert inst["id"] == "c0" and inst["role"] == "coupled" and inst["device"] == "cpu"
    assert inst["num_decode_tokens"] > 0 and inst["busy_s"] > 0
    assert snap["counts"]["finished"] >= 1 and snap["links"] == []


def test_prefix_cache_counts_hits_and_a_cache_salt_keeps_tenants_apart(server, client):
    """The same prompt twice: the second finds every full block before its last token cached; a
    third with another cache_salt finds nothing. /v1/stats and /metrics count it (vLLM's names)."""
    ids = bundle().tokenizer.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 12))
    before = server.wait_idle()["prefix_cache"]
    for extra in ({}, {}, {"extra_body": {"cache_salt": "tenant-b"}}):
        client.completions.create(model="default", prompt=ids, max_tokens=2, temperature=0, **extra)
    after = server.wait_idle()["prefix_cache"]
    assert after["enabled"] and after["queries"] - before["queries"] == 3 * len(ids)
    assert after["hits"] - before["hits"] == (len(ids) - 1) // 16 * 16  # the second only
    text = server.request("GET", "/metrics")[2].decode()
    for name in ("vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{", "aserve:cached_blocks{"):
        assert name in text, name


def test_a_streamed_line_break_character_stays_inside_its_event(server):
    """JSON leaves NEL, U+2028 and U+2029 raw, and line readers built on str.splitlines (httpx's
    aiter_lines, which guidellm reads streams with) end a line at each: one sampled token holding
    one broke guidellm's JSON mid-event. A streamed echo of a prompt holding all three, split as
    those readers split it: every data line is whole JSON, and the text comes back unchanged."""
    prompt = "Line\u2028one\x85two\u2029three"
    body = {"model": "default", "prompt": prompt, "echo": True, "max_tokens": 2, "temperature": 0, "stream": True}
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 200
    lines = [line for line in raw.decode().splitlines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]).startswith(prompt)
