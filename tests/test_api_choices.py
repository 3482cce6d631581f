"""Several choices in one response: ``n`` > 1, a list of prompts, token-id prompts (a list of
lists), continuous usage stats; every choice's request is aborted when the client goes away."""
import asyncio

import aiohttp
import pytest

from tests.api_support import bundle, coupled_server as server, iter_sse, openai_client, sse_events  # noqa: F401

pytestmark = pytest.mark.slow
MSGS = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_n_choices_are_indexed_and_counted(client):
    out = client.chat.completions.create(model="default", messages=MSGS, n=3, max_tokens=5, temperature=1.0, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    one = client.chat.completions.create(model="default", messages=MSGS, max_tokens=5, temperature=1.0, seed=11)
    assert out.choices[0].message.content == one.choices[0].message.content  # choice j draws from seed + j
    assert out.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert out.usage.completion_tokens <= 15


def test_n_streamed(server):
    body = {"model": "default", "messages": MSGS, "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    status, _, raw = server.request("POST", "/v1/chat/completions", body)
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 8
    chunks = events[:-2]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
    texts = ["".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == i)
             for i in (0, 1)]
    assert texts[0] == texts[1]  # greedy: both choices say the same


def test_a_list_of_prompts_and_token_id_prompts(client):
    texts = ["The capital of France is", "One, two, three,"]
    kw = dict(model="default", max_tokens=4, temperature=0)
    batch = client.completions.create(prompt=texts, n=2, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]  # prompt-major: prompt i's n choices together
    singles = [client.completions.create(prompt=t, **kw).choices[0].text for t in texts]
    assert [c.text for c in batch.choices] == [singles[0], singles[0], singles[1], singles[1]]
    ids = [bundle().tokenizer.encode(t) for t in texts]
    by_ids = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in by_ids.choices] == singles
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))


@pytest.mark.parametrize("path,source", [("/v1/chat/completions", {"messages": MSGS}),
                                         ("/v1/completions", {"prompt": "Hello"})])
def test_continuous_usage_stats(server, path, source):
    """vLLM's extension, as guidellm sends it: usage on every chunk, counting up; totals last."""
    body = {"model": "default", **source, "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    status, _, raw = server.request("POST", path, body)
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    final, chunks = events[-2], events[:-2]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(c["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"] for c in chunks)
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)


def test_every_choice_is_aborted_when_the_client_goes_away(server):
    body = {"model": "default", "prompt": ["Count:", "List:"], "n": 3, "max_tokens": 300, "ignore_eos": True,
            "stream": True}

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                seen = 0
                async for _ in iter_sse(resp):
                    seen += 1
                    if seen == 8:
                        break  # leave with six requests mid-way

    asyncio.run(go())
    snap = server.wait_idle()
    assert snap["counts"]["aborted"] >= 6
