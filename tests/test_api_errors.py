"""Bad input gets an OpenAI-style 4xx naming the parameter; fuzzed bodies never get a 5xx;
api key (401), back-pressure (429) and body limit (413)."""
import asyncio
import http.client
import json

import aiohttp
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from aserve.api.server import ServerSettings
from aserve.config import ClusterConfig
from tests.api_support import ServerThread

pytestmark = pytest.mark.slow
CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]
KEY = "test-key-123"


@pytest.fixture(scope="module")
def server():
    with ServerThread(ClusterConfig(mode="coupled", num_coupled=1)) as s:
        yield s


@pytest.fixture(scope="module")
def guarded():
    settings_ = ServerSettings(api_key=KEY, max_queued_requests=2, max_body_bytes=4096)
    with ServerThread(ClusterConfig(mode="coupled", num_coupled=1), settings_) as s:
        yield s


def chat(**kw):
    return {"model": "default", "messages": MSGS, "max_tokens": 2, **kw}


def comp(**kw):
    return {"model": "default", "prompt": "Hi", "max_tokens": 2, **kw}


def check_error(status, body, want_status, want_param):
    assert status == want_status, body[:300]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == want_param, err
    assert len(body) < 1000, "an error never echoes the input"


TABLE = [  # (path, body, status, error.param)
    (CHAT, b"{", 400, None), (CHAT, b"[1, 2]", 400, None), (CHAT, b'"text"', 400, None),
    (CHAT, b"\xff\xfe{}", 400, None), (COMPLETION, b'{"model": "default", "prompt": "a", "top_p": NaN}', 400, None),
    (CHAT, b"[" * 100_000, 400, None), (CHAT, b"", 400, None),
    (CHAT, {"messages": MSGS}, 400, "model"), (CHAT, chat(model=5), 400, "model"),
    (CHAT, chat(model="gpt-9"), 404, "model"), (COMPLETION, comp(model="gpt-9"), 404, "model"),
    (CHAT, {"model": "default"}, 400, "messages"), (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages="hi"), 400, "messages"), (CHAT, chat(messages=[5]), 400, "messages[0]"),
    (CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    (CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages[0].role"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "name": "bob"}]), 400, "messages[0].name"),
    (COMPLETION, {"model": "default"}, 400, "prompt"), (COMPLETION, comp(prompt=""), 400, "prompt"),
    (COMPLETION, comp(prompt=[]), 400, "prompt"), (COMPLETION, comp(prompt=[-1]), 400, "prompt"),
    (COMPLETION, comp(prompt=[10**6]), 400, "prompt"), (COMPLETION, comp(prompt=["a", [1]]), 400, "prompt"),
    (COMPLETION, comp(prompt=5), 400, "prompt"), (COMPLETION, comp(prompt=[[1], []]), 400, "prompt"),
    (COMPLETION, comp(prompt=["a", ""]), 400, "prompt"), (COMPLETION, comp(prompt=["a"] * 257), 400, "prompt"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"), (CHAT, chat(max_tokens="5"), 400, "max_tokens"),
    (CHAT, chat(max_tokens=1.5), 400, "max_tokens"), (CHAT, chat(max_tokens=True), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CHAT, chat(max_completion_tokens=3), 400, "max_tokens"),
    (CHAT, chat(max_tokens=9000), 400, "messages"), (COMPLETION, comp(max_tokens=8192), 400, "prompt"),
    (CHAT, chat(temperature=-0.1), 400, "temperature"), (CHAT, chat(temperature=2.5), 400, "temperature"),
    (CHAT, chat(temperature="hot"), 400, "temperature"), (CHAT, chat(top_p=0), 400, "top_p"),
    (CHAT, chat(top_p=1.5), 400, "top_p"), (CHAT, chat(top_p=-1e-300), 400, "top_p"), (CHAT, chat(top_k=-2), 400, "top_k"), (CHAT, chat(top_k=1.5), 400, "top_k"),
    (CHAT, chat(seed="x"), 400, "seed"), (CHAT, chat(seed=2**70), 400, "seed"),
    (CHAT, chat(stop=5), 400, "stop"), (CHAT, chat(stop=[""]), 400, "stop"), (CHAT, chat(stop=["a"] * 17), 400, "stop"),
    (CHAT, chat(ignore_eos="yes"), 400, "ignore_eos"), (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT, chat(stream=True, stream_options={"x": 1}), 400, "stream_options"),
    (CHAT, chat(stream=True, stream_options={"continuous_usage_stats": 1}), 400, "stream_options.continuous_usage_stats"),
    (CHAT, chat(n=0), 400, "n"), (CHAT, chat(n=257), 400, "n"), (COMPLETION, comp(prompt=["a"] * 9, n=30), 400, "n"),
    (CHAT, chat(logprobs=1), 400, "logprobs"), (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"), (COMPLETION, comp(logprobs=21), 400, "logprobs"),
    (COMPLETION, comp(logprobs=True), 400, "logprobs"), (COMPLETION, comp(echo="yes"), 400, "echo"),
    (COMPLETION, comp(max_tokens=0), 400, "max_tokens"), (CHAT, chat(echo=True), 400, "echo"),
    (COMPLETION, comp(best_of=2), 400, "best_of"), (COMPLETION, comp(suffix="x"), 400, "suffix"),
    (COMPLETION, comp(repetition_penalty=1.2), 400, "repetition_penalty"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    (CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    (CHAT, chat(response_format={"type": "json_object"}), 400, "response_format"),
    (CHAT, chat(presence_penalty=0.5), 400, "presence_penalty"), (CHAT, chat(foo=1), 400, "foo"),
    (COMPLETION, comp(messages=MSGS), 400, "messages"), (CHAT, chat(prompt="x"), 400, "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", TABLE, ids=[f"{i}" for i in range(len(TABLE))])
def test_validation_table(server, path, body, status, param):
    got_status, _, got = server.request("POST", path, body)
    check_error(got_status, got, status, param)


@pytest.mark.parametrize("extra", [dict(n=1), dict(presence_penalty=0, frequency_penalty=0.0), dict(user="u"),
                                   dict(logprobs=False, top_logprobs=0), dict(logprobs=None, top_logprobs=None),
                                   dict(repetition_penalty=1.0),
                                   dict(response_format={"type": "text"}, tools=[], logprobs=False),
                                   dict(stream=False, stream_options=None, logit_bias={}), dict(top_k=-1)])
def test_noop_values_are_accepted(server, extra):
    status, _, body = server.request("POST", CHAT, chat(**extra))
    assert status == 200, body


@pytest.mark.parametrize("extra", [dict(top_p=2.2e-309, temperature=1.0), dict(temperature=1e-300),
                                   dict(temperature=2, top_k=1), dict(seed=2**64 - 1), dict(seed=-2**63)])
def test_extreme_sampling_values_are_served(server, extra):
    status, _, body = server.request("POST", CHAT, chat(**extra), timeout=60)
    assert status == 200, body
    assert server.request("GET", "/health")[0] == 200


def test_routes_and_methods(server):
    status, _, body = server.request("GET", "/v1/nothing")
    check_error(status, body, 404, None)
    status, headers, body = server.request("GET", CHAT)
    check_error(status, body, 405, None)
    status, _, body = server.request("POST", COMPLETION, comp(prompt="x" * 300_000, temperature=-1))
    check_error(status, body, 400, "temperature")


# ---- fuzz -------------------------------------------------------------------------------------
LEAF = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12)
ANY = st.recursive(LEAF, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                   max_leaves=8)


def mostly(valid, garbage=ANY):
    """Valid values far more often than garbage, so fuzzing reaches the engine too."""
    return st.integers(0, 9).flatmap(lambda i: garbage if i == 4 else valid)  # hypothesis favours range ends


MESSAGE = st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "system", "assistant", "developer"])),
                                 "content": mostly(st.text(max_size=20))}, optional={"name": ANY})
SOURCE = {CHAT: ("messages", mostly(st.lists(MESSAGE, min_size=1, max_size=3))),
          COMPLETION: ("prompt", mostly(st.text(min_size=1, max_size=30) | st.lists(st.integers(-3, 50_000), max_size=6)))}
PARAMS = {
    "max_tokens": mostly(st.integers(0, 5)), "max_completion_tokens": mostly(st.integers(0, 5)),
    "temperature": mostly(st.floats(0, 2.2)), "top_p": mostly(st.floats(0, 1)), "top_k": mostly(st.integers(-2, 60_000)),
    "seed": mostly(st.integers(-2**63, 2**64)), "stop": mostly(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3)),
    "ignore_eos": mostly(st.booleans()), "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "n": mostly(st.sampled_from([None, 1, 2])), "logprobs": mostly(st.sampled_from([None, False, True, 1])),
    "tools": mostly(st.sampled_from([None, [], [{"type": "function"}]])), "user": mostly(st.text(max_size=5)),
    "response_format": mostly(st.sampled_from([None, {"type": "text"}, {"type": "json_object"}])),
    "echo": mostly(st.sampled_from([None, False, True])),
}

ONLY = {CHAT: {"max_completion_tokens", "tools", "response_format"}, COMPLETION: {"echo"}}


@st.composite
def bodies(draw):
    """A body that is usually close to valid: a model, a prompt, a few parameters, sometimes junk."""
    path = draw(st.sampled_from([CHAT, COMPLETION]))
    key, source = SOURCE[path]
    body = {"model": draw(mostly(st.sampled_from(["default", "smollm2-135m-instruct", "nope"]))), key: draw(source)}
    names = sorted(set(PARAMS) - ONLY[COMPLETION if path == CHAT else CHAT])
    for name in draw(st.sets(st.sampled_from(names), max_size=4)):
        body[name] = draw(PARAMS[name])
    if draw(st.integers(0, 19)) == 13:
        body[draw(st.text(max_size=10))] = draw(ANY)
    if draw(st.integers(0, 19)) == 13:
        body.pop(draw(st.sampled_from(["model", key])))
    return path, body


def _short_generation(body):
    """Keep valid requests fast: no missing, null or large max_tokens."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if key in body and (body[key] is None or (type(body[key]) is int and body[key] > 5)):
                body[key] = 3
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 3
    return body


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=mostly(bodies(), st.tuples(st.sampled_from([CHAT, COMPLETION]), ANY | st.binary(max_size=40))))
def test_fuzz_never_5xx(server, case):
    path, body = case
    raw = body if isinstance(body, bytes) else json.dumps(_short_generation(body)).encode()
    status, headers, got = server.request("POST", path, raw, timeout=60)
    assert status < 500, (status, got[:300], raw[:300])
    event(f"status {status}")
    if status >= 400:
        assert set(json.loads(got)["error"]) == {"message", "type", "param", "code"}
    elif not headers["Content-Type"].startswith("text/event-stream"):
        assert json.loads(got)["usage"]["completion_tokens"] <= 5 * len(json.loads(got)["choices"])


def test_fuzz_leaves_the_engine_alive_and_idle(server):
    assert server.request("GET", "/health")[0] == 200
    server.wait_idle()


# ---- api key, back-pressure, body limit ---------------------------------------------------------
def test_api_key(guarded):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, got_headers, body = guarded.request("POST", CHAT, chat(), headers=headers, auth=False)
        check_error(status, body, 401, None)
        assert got_headers["WWW-Authenticate"] == "Bearer"
    assert guarded.request("GET", "/metrics", auth=False)[0] == 401
    assert guarded.request("GET", "/v1/stats", auth=False)[0] == 401
    assert guarded.request("GET", "/health", auth=False)[0] == 200, "health stays open for probes"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(**chat()).choices[0].finish_reason in ("stop", "length")


def test_body_limit(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, body = guarded.request("POST", CHAT, comp(prompt="x" * 5000))
    check_error(status, body, 413, None)
    conn = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=30)
    try:  # chunked: no Content-Length to refuse up front
        conn.request("POST", COMPLETION, body=iter([b'{"prompt": "' + b"x" * 3000, b"x" * 3000 + b'"}']),
                     headers={**auth, "Content-Type": "application/json"}, encode_chunked=True)
        resp = conn.getresponse()
        check_error(resp.status, resp.read(), 413, None)
    finally:
        conn.close()


def test_back_pressure(guarded):
    prompt = " ".join(f"word{i}" for i in range(150))

    async def one(session):
        async with session.post(guarded.url + COMPLETION, json=comp(prompt=prompt, max_tokens=2),
                                headers={"Authorization": f"Bearer {KEY}"}) as r:
            return r.status, r.headers.get("Retry-After"), await r.json()

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*[one(session) for _ in range(16)])

    results = asyncio.run(main())
    statuses = [s for s, _, _ in results]
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
    assert set(statuses) <= {200, 429}
    for status, retry_after, body in results:
        if status == 429:
            assert retry_after == "1" and body["error"]["type"] == "rate_limit_error"
    guarded.wait_idle()
