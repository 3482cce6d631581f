"""Replay against a running OpenAI-compatible server: streaming ``POST /v1/completions``.

Each request sends its prompt as token ids with ``max_tokens`` = the trace's output length,
``temperature`` 0, ``ignore_eos`` (vLLM's extension; servers that ignore it may stop early) and
``stream_options.include_usage``. Token times are the arrival times of chunks that carry text;
a server that holds back text (partial UTF-8, stop-string look-ahead) merges tokens into one
chunk, so TBT over HTTP is an upper bound, and the token count comes from ``usage`` when sent.
An aserve server's ``/v1/stats`` is polled during the replay for resource usage, padding, KV
bytes and the instance timeline; other servers report those as n/a. The JSON also carries the
numbers under ``vllm bench serve``'s names (aserve/replay/vllm_names.py).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Optional, Sequence

from aserve.replay.driver import SAMPLE_PERIOD_S, ReplayProgress, drive
from aserve.replay.report import InstanceRecord, RequestRecord, SystemRun
from aserve.replay.traces import Trace, TraceRequest
from aserve.replay.urls import api_base
from aserve.replay.vllm_names import vllm_fields


class _Stream:
    """What one streamed response said: token times, finish reason, usage, error."""

    def __init__(self, base: float):
        self.base, self.token_times, self.finish_reason = base, [], None
        self.usage_tokens: Optional[int] = None
        self.error: Optional[str] = None

    def feed(self, data: bytes, progress: ReplayProgress) -> bool:
        """One ``data:`` payload; returns False at ``[DONE]``."""
        if data == b"[DONE]":
            return False
        obj = json.loads(data)
        if "error" in obj:
            err = obj["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        for choice in obj.get("choices") or []:
            text = choice.get("text")
            if text is None:  # a chat-shaped chunk
                text = (choice.get("delta") or {}).get("content")
            if text:
                self.token_times.append(time.monotonic() - self.base)
                progress.token()
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
        return True


class HttpTarget:
    """A session to one server; ``send`` replays one request and returns its record."""

    def __init__(self, url: str, model: Optional[str] = None, read_timeout_s: float = 600.0):
        self.base_url, self.model, self.read_timeout_s = api_base(url), model, read_timeout_s
        self.session = None

    async def __aenter__(self):
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.read_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout)
        if self.model is None:
            self.model = await self._first_model()
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    async def _first_model(self) -> str:
        try:
            async with self.session.get(f"{self.base_url}/v1/models") as resp:
                data = (await resp.json()).get("data") or []
                return data[0]["id"] if data else "default"
        except Exception as e:  # noqa: BLE001 - any failure here means the server is not usable
            raise ConnectionError(f"cannot list models at {self.base_url}/v1/models: {e}") from None

    def payload(self, ids: list[int], req: TraceRequest) -> dict:
        return {"model": self.model, "prompt": ids, "max_tokens": req.output_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def send(self, i: int, req: TraceRequest, ids: list[int], base: float,
                   progress: ReplayProgress) -> RequestRecord:
        import aiohttp

        arrival, st = time.monotonic() - base, _Stream(base)
        status = "completed"
        try:
            async with self.session.post(f"{self.base_url}/v1/completions", json=self.payload(ids, req)) as resp:
                if resp.status != 200:
                    st.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                else:
                    async for line in resp.content:
                        line = line.strip()
                        if line.startswith(b"data:") and not st.feed(line[5:].strip(), progress):
                            break
        except asyncio.CancelledError:
            status = "aborted"
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            st.error = f"{type(e).__name__}: {e}"
        progress.request_done()
        if status == "completed" and (st.error or not st.token_times or st.finish_reason in (None, "error")):
            status = "failed"
        if st.finish_reason == "abort":
            status = "aborted"
        finish = st.token_times[-1] if st.token_times else None
        reported = st.usage_tokens if st.usage_tokens not in (None, len(st.token_times)) else None
        return RequestRecord(i, len(ids), req.output_tokens, arrival, status, None,
                             st.token_times[0] if st.token_times else None, finish, tuple(st.token_times),
                             error=st.error or (None if status == "completed" else "no finish from the server"),
                             reported_output_tokens=reported)


class _StatsSampler:
    """Polls an aserve server's ``/v1/stats`` (instances' busy seconds, roles, blocks, link bytes);
    a server without it leaves the system's internals unknown (no instances in the report)."""

    def __init__(self, target: HttpTarget, base: float):
        self.target, self.base, self.snaps = target, base, []

    async def take(self) -> bool:
        try:
            async with self.target.session.get(f"{self.target.base_url}/v1/stats") as resp:
                if resp.status != 200:
                    return False
                snap = await resp.json()
        except Exception:  # noqa: BLE001 - no stats endpoint: nothing to sample
            return False
        if not isinstance(snap, dict) or "instances" not in snap:
            return False
        self.snaps.append((time.monotonic() - self.base, snap))
        return True

    async def run(self) -> None:
        while await self.take():
            await asyncio.sleep(SAMPLE_PERIOD_S)

    def instances(self) -> tuple:
        if len(self.snaps) < 2:
            return ()
        first = {i["id"]: i for i in self.snaps[0][1]["instances"]}
        last = {i["id"]: i for i in self.snaps[-1][1]["instances"]}
        out = []
        for iid, i1 in last.items():
            i0 = first.get(iid, {})
            d = lambda k: i1.get(k, 0) - i0.get(k, 0)  # noqa: E731
            samples = tuple((t, i["busy_s"] - i0.get("busy_s", 0.0), i["role"]) for t, snap in self.snaps
                            for i in snap["instances"] if i["id"] == iid)
            out.append(InstanceRecord(iid, i1["role"], d("busy_s"), d("num_prefill_tokens"), d("num_decode_tokens"),
                                      d("num_pad_tokens"), i0.get("free_blocks", 0), i1.get("free_blocks", 0), samples))
        return tuple(out)

    def kv_bytes(self) -> Optional[int]:
        if len(self.snaps) < 2:
            return None
        total = [sum(link.get("bytes", 0) for link in snap.get("links", [])) for _, snap in (self.snaps[0], self.snaps[-1])]
        return int(total[1] - total[0])


async def replay_http(url: str, name: str, trace: Trace, prompts: Sequence[list[int]],
                      progress: Optional[ReplayProgress] = None, model: Optional[str] = None,
                      timeout_s: Optional[float] = None) -> SystemRun:
    """Replay ``trace`` against the server at ``url``; an aserve server's /v1/stats adds its internals."""
    progress = progress or ReplayProgress(False)
    async with HttpTarget(url, model) as target:
        base = time.monotonic()
        stats = _StatsSampler(target, base)
        sampler = asyncio.create_task(stats.run()) if await stats.take() else None
        progress.system(name, trace)
        try:
            records = await drive(trace, lambda i: target.send(i, trace.requests[i], prompts[i], base, progress),
                                  timeout_s)
        finally:
            if sampler:
                sampler.cancel()
        if sampler:
            await stats.take()
    flips = stats.snaps[-1][1].get("num_flips") if stats.snaps else None
    served = (stats.snaps[-1][1].get("predictor") or {}) if stats.snaps else {}
    predictor = {k: served[k] for k in ("name", "granularity", "mode") if k in served} or None
    return SystemRun(name, tuple(records), stats.instances(), stats.kv_bytes(), flips,
                     config={"url": url, "model": target.model}, vllm=vllm_fields(records), predictor=predictor)
