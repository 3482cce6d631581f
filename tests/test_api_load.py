"""Many concurrent streaming clients on a disaggregated 1:1 cluster; half of a second wave
hangs up mid-stream. Every survivor finishes complete and every block comes back."""
import asyncio
import random

import aiohttp
import openai
import pytest

from aserve.config import ClusterConfig
from tests.api_support import ServerThread, iter_sse

pytestmark = pytest.mark.slow
N = 64


@pytest.fixture(scope="module")
def server():
    with ServerThread(ClusterConfig(mode="disagg", num_prefill=1, num_decode=1)) as s:
        yield s


def make_request(rng: random.Random, i: int) -> tuple[str, dict]:
    """Mixed prompt lengths (a few to ~250 tokens), 4-24 output tokens, chat and completions."""
    words = " ".join(f"item{j}" for j in range(rng.choice([1, 3, 10, 40, 80])))
    body = {"model": "default", "max_tokens": rng.randint(4, 24), "ignore_eos": rng.random() < 0.5,
            "temperature": rng.choice([0, 0.8]), "seed": i, "stream": True}
    if i % 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Repeat: {words}"}]}
    return "/v1/completions", {**body, "prompt": f"List: {words}"}


@pytest.mark.long  # 40 s: the 2-minute soak streams concurrent clients through the server too (faults on)
def test_concurrent_streams_all_finish(server):
    rng = random.Random(1)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    baseline = server.wait_idle()

    async def one(i):
        path, body = make_request(rng, i)
        kw = {k: body[k] for k in ("model", "max_tokens", "temperature", "seed")}
        extra = {"ignore_eos": body["ignore_eos"]}
        if path.endswith("chat/completions"):
            stream = await client.chat.completions.create(messages=body["messages"], stream=True, extra_body=extra,
                                                          stream_options={"include_usage": True}, **kw)
        else:
            stream = await client.completions.create(prompt=body["prompt"], stream=True, extra_body=extra,
                                                     stream_options={"include_usage": True}, **kw)
        chunks = [c async for c in stream]
        return body, chunks

    async def main():
        return await asyncio.gather(*[one(i) for i in range(N)])

    for body, chunks in asyncio.run(main()):
        usage = chunks[-1].usage
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(reasons) == 1 and reasons[0] in ("stop", "length"), reasons
        assert 1 <= usage.completion_tokens <= body["max_tokens"]
        if body["ignore_eos"] or reasons[0] == "length":
            assert usage.completion_tokens == body["max_tokens"] and reasons[0] == "length"
    snap = server.wait_idle()
    assert snap["counts"]["finished"] - baseline["counts"]["finished"] == N
    (link,) = snap["links"]
    assert link["num_done"] >= 1 and link["bytes"] > 0


async def _read_stream(resp: aiohttp.ClientResponse, hang_up_after: int | None) -> dict:
    """Read SSE events; with ``hang_up_after`` close the connection after that many."""
    events = []
    if hang_up_after == 0:
        resp.close()
        return {"hung_up": True}
    async for event in iter_sse(resp):
        events.append(event)
        if hang_up_after is not None and len(events) >= hang_up_after:
            resp.close()
            return {"hung_up": True}
    return {"hung_up": False, "events": events}


@pytest.mark.long  # the 2-minute soak cuts a third of its requests and checks every block
def test_half_hang_up_blocks_come_back(server):
    rng = random.Random(2)
    baseline = server.wait_idle()

    async def one(session, i):
        path, body = make_request(rng, i)
        if i % 2 == 0:  # a survivor
            async with session.post(server.url + path, json=body) as resp:
                assert resp.status == 200
                return body, await _read_stream(resp, None)
        if i % 8 == 1:  # a non-streaming client that gives up: aiohttp cancels its handler
            body = {**body, "stream": False, "max_tokens": 400, "ignore_eos": True}
            try:
                async with session.post(server.url + path, json=body, timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                    return body, {"hung_up": False, "late": await r.json()}
            except asyncio.TimeoutError:
                return body, {"hung_up": True}
        await asyncio.sleep(rng.random() * 0.5)
        resp = await session.post(server.url + path, json=body)
        return body, await _read_stream(resp, rng.randint(0, 4))

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*[one(session, i) for i in range(N)])

    results = asyncio.run(main())
    for i, (body, result) in enumerate(results):
        if i % 2:
            continue
        events = result["events"]
        assert events[-1] == "[DONE]"
        reasons = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
        assert len(reasons) == 1 and reasons[0] in ("stop", "length")
    snap = server.wait_idle()
    for before, after in zip(baseline["instances"], snap["instances"]):
        assert after["free_blocks"] == before["free_blocks"] == after["total_blocks"]
    assert snap["counts"]["aborted"] > baseline["counts"]["aborted"]
