"""The real command in a subprocess: SIGTERM drains (503 for new work), lets a short request
finish, aborts a long one (finish_reason "abort", still a clean end of stream), and exits 0."""
import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.api_support import iter_sse

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def served():
    cmd = [sys.executable, "cli.py", "serve", "--mode", "coupled", "--instances", "1", "--port", "0",
           "--kv-cache-gb", "0.1", "--threads", "1", "--shutdown-timeout", "3"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for line in proc.stderr:
            m = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
            if m:
                yield proc, m.group(1)
                break
        else:
            pytest.fail(f"server did not start (exit code {proc.wait()})")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def _events(resp, first_event: asyncio.Event):
    events = []
    async for event in iter_sse(resp):
        events.append(event)
        first_event.set()
    return events


def _finish_reasons(events):
    return [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]


def test_sigterm_drains_then_aborts(served):
    proc, url = served

    async def stream(session, max_tokens, started):
        body = {"model": "default", "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            return await _events(resp, started)

    async def main():
        async with aiohttp.ClientSession() as session:
            long_started, short_started = asyncio.Event(), asyncio.Event()
            long = asyncio.create_task(stream(session, 4000, long_started))
            await long_started.wait()
            short = asyncio.create_task(stream(session, 12, short_started))
            await short_started.wait()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with session.get(url + "/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "draining"
            async with session.post(url + "/v1/completions", json={"model": "default", "prompt": "x"}) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "draining"
            return await long, await short

    long_events, short_events = asyncio.run(main())
    assert short_events[-1] == "[DONE]" and _finish_reasons(short_events) == ["length"]
    assert long_events[-1] == "[DONE]" and _finish_reasons(long_events) == ["abort"]
    assert proc.wait(timeout=30) == 0
