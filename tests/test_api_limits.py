"""What one request may cost, on a live server (make serve's default layout: two coupled
instances) with the openai client: --max-tokens (ceiling and default), --max-request-tokens
(n x (prompt + max_tokens)), --max-logprob-entries (echo x logprobs), and --max-queued-requests
counted in choices for the whole request; each refusal an OpenAI-shaped 400 or 429 that names
the flag that raises the limit."""
import asyncio
import json
import time

import aiohttp
import openai
import pytest

from aserve.api.server import ServerSettings
from aserve.config import ClusterConfig
from tests.api_support import ServerThread

pytestmark = pytest.mark.slow
LIMITS = ServerSettings(max_tokens=8, max_request_tokens=600, max_logprob_entries=500, max_queued_requests=20)
MSGS = [{"role": "user", "content": "Tell me a long story about a dragon."}]


@pytest.fixture(scope="module")
def server():
    with ServerThread(ClusterConfig(mode="coupled", num_coupled=2), LIMITS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def refused(call, status: int, flag: str, param: str) -> dict:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    err = info.value
    assert err.status_code == status, err
    body = err.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["param"] == param, body
    assert flag in body["message"], body
    return body


def test_max_tokens_is_a_ceiling_and_the_default(client, server):
    body = refused(lambda: client.chat.completions.create(model="default", messages=MSGS, max_tokens=9),
                   400, "--max-tokens", "max_tokens")
    assert body["code"] == "max_tokens_exceeded" and "at most 8" in body["message"]
    out = client.chat.completions.create(model="default", messages=MSGS, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    assert client.chat.completions.create(model="default", messages=MSGS, max_tokens=8).usage.completion_tokens <= 8
    server.wait_idle()


def test_n_times_prompt_plus_max_tokens_is_bounded(client, server):
    ok = client.completions.create(model="default", prompt=ids(100), n=5, max_tokens=8, temperature=1.0, seed=3,
                                   extra_body={"ignore_eos": True})  # 5 x (100 + 8) = 540
    assert len(ok.choices) == 5 and ok.usage.completion_tokens == 40
    body = refused(lambda: client.completions.create(model="default", prompt=ids(100), n=6, max_tokens=8),
                   400, "--max-request-tokens", "max_tokens")  # 6 x 108 = 648
    assert "648" in body["message"] and body["code"] == "request_too_large"
    refused(lambda: client.completions.create(model="default", prompt=[ids(280), ids(320, 2000)], max_tokens=8),
            400, "--max-request-tokens", "max_tokens")  # summed over the prompts: 288 + 328
    # no max_tokens: each of 14 choices gets its even share, 600 // 14 = 42 tokens with its prompt
    out = client.chat.completions.create(model="default", messages=MSGS, n=14, temperature=1.0,
                                         extra_body={"ignore_eos": True})
    per_choice = 600 // 14 - out.usage.prompt_tokens
    assert 1 <= per_choice < 8 and out.usage.completion_tokens == 14 * per_choice  # below --max-tokens
    assert 14 * out.usage.prompt_tokens + out.usage.completion_tokens <= 600
    refused(lambda: client.chat.completions.create(model="default", messages=MSGS * 8, n=16), 400,
            "--max-request-tokens", "n")  # a prompt longer than its share: refused, not cut
    server.wait_idle()


def test_echo_times_logprobs_is_bounded(client, server):
    ok = client.completions.create(model="default", prompt=ids(60), echo=True, logprobs=5, max_tokens=0)
    assert len(ok.choices[0].logprobs.tokens) == 60  # 60 x 6 = 360 entries
    body = refused(lambda: client.completions.create(model="default", prompt=ids(100), echo=True, logprobs=5,
                                                     max_tokens=0), 400, "--max-logprob-entries", "logprobs")
    assert "600" in body["message"] and body["code"] == "logprobs_too_large"  # 100 x (5 + 1)
    refused(lambda: client.completions.create(model="default", prompt=ids(20), n=4, echo=True, logprobs=4,
                                              max_tokens=8), 400, "--max-logprob-entries", "logprobs")  # 4 x 28 x 5
    server.wait_idle()


def test_siblings_share_one_prefill_and_answer_as_one(client, server):
    """n = 4 greedy: four identical answers, the n = 1 answer, and the prompt computed about
    once (/v1/stats' prompt rows), not four times."""
    prompt = ids(130, 5000)
    one = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    server.wait_idle()
    before = sum(i["num_prefill_tokens"] for i in server.stats()["instances"])
    out = client.completions.create(model="default", prompt=prompt, n=4, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [one] * 4
    computed = sum(i["num_prefill_tokens"] for i in server.wait_idle()["instances"]) - before
    assert computed <= 130 + 3 * 2, computed  # 130 rows, then 130 - 128 = 2 for each sibling


@pytest.fixture(scope="module")
def queue_server():
    with ServerThread(ClusterConfig(mode="coupled", num_coupled=1), ServerSettings(max_queued_requests=4)) as s:
        yield s


def test_the_queue_counts_choices_and_checks_a_whole_request(queue_server):
    """A request of 5 choices can never fit a queue of 4 (400). While 3 choices wait for their
    first token, a request of 2 more is refused (429): counted as one request, it would have gone in."""
    s = queue_server
    status, _, raw = s.request("POST", "/v1/completions", {"model": "default", "prompt": "Hi", "n": 5, "max_tokens": 1})
    err = json.loads(raw)["error"]
    assert status == 400 and "--max-queued-requests" in err["message"] and err["param"] == "n"

    async def main():
        async with aiohttp.ClientSession() as session:
            long_one = asyncio.ensure_future(session.post(s.url + "/v1/completions", json={
                "model": "default", "prompt": ids(400), "n": 3, "max_tokens": 1}))
            deadline = time.monotonic() + 60
            while (await asyncio.to_thread(s.stats))["num_waiting"] < 3:  # its 3 choices wait for a first token
                assert time.monotonic() < deadline and not long_one.done()
                await asyncio.sleep(0.01)
            async with session.post(s.url + "/v1/completions", json={"model": "default", "prompt": "Hi", "n": 2,
                                                                     "max_tokens": 1}) as r:
                second = r.status, r.headers.get("Retry-After"), await r.json()
            async with await long_one as r:
                first = r.status
            return first, second

    first, (status, retry_after, body) = asyncio.run(main())
    assert first == 200
    assert status == 429 and retry_after == "1" and body["error"]["type"] == "rate_limit_error", body
    assert "3 choices wait" in body["error"]["message"] and "--max-queued-requests" in body["error"]["message"]
    s.wait_idle()
    assert s.request("POST", "/v1/completions", {"model": "default", "prompt": "Hi", "n": 2, "max_tokens": 1})[0] == 200


def test_max_tokens_context_generates_what_fits():
    """``--max-tokens context`` (vLLM's default): a chat without max_tokens runs to the end of
    what fits, here a KV pool of four blocks (63 tokens; the ceiling's own test is above)."""
    from aserve.config import EngineConfig

    small = EngineConfig(kv_cache_gb=0.004, num_threads=1)
    body = {"model": "default", "messages": [{"role": "user", "content": "Count."}], "ignore_eos": True}
    with ServerThread(ClusterConfig(mode="coupled", num_coupled=1), ServerSettings(max_tokens=None), small) as s:
        room = s.server.ctx.pool_tokens
        status, _, raw = s.request("POST", "/v1/chat/completions", body)
        assert status == 200, raw
        usage = json.loads(raw)["usage"]
        assert usage["completion_tokens"] == room - usage["prompt_tokens"] > 8, (room, usage)


def test_the_flags_parse():
    from aserve.commands import build_parser
    from aserve.commands.serve import server_settings

    parse = lambda *flags: server_settings(build_parser().parse_args(["serve", *flags]))  # noqa: E731
    default = parse()
    assert (default.max_tokens, default.max_request_tokens, default.max_logprob_entries,
            default.max_queued_requests) == (2048, 32768, 262144, 1024)
    assert parse("--max-tokens", "context").max_tokens is None
    assert parse("--max-tokens", "64", "--max-queued-requests", "0").max_queued_requests == 0
    for bad in (["--max-tokens", "0"], ["--max-tokens", "lots"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
    with pytest.raises(ValueError, match="max_request_tokens"):
        parse("--max-request-tokens", "1")
