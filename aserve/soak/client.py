"""The soak's load: the trace cycled for the duration, sent over HTTP from a thread with its own
event loop (so the server's loop lag is the server's), ``max_in_flight`` at a time.

Each request gets a plan when it is sent: ``complete``, or (``cut_fraction`` of them) a cut at a
random point: ``disconnect`` (the client goes away after that many chunks, or for a non-streamed
request after that many milliseconds) or ``abort`` (after that many chunks the server is asked to
abort it; its stream must then end with ``finish_reason: "abort"`` and ``[DONE]``).

Outcomes, from what the client saw: ``completed`` (finish ``length``), ``errored`` (an error it
can read: an HTTP error with a JSON body, or an SSE error event), ``aborted``, ``disconnected``
(its own cut), ``lost`` (anything else: a torn stream, an end without ``[DONE]``, no end at all).
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from aserve.replay.traces import Trace, TraceRequest
from aserve.soak.settings import SoakConfig

FINAL_S = 30.0  # after the drain's aborts: how long a request may take to end before it counts as lost
NON_STREAM_CUT_MS = 5000  # a non-streamed request's disconnect comes within this


@dataclass
class SoakRecord:
    """One request of the soak, as the client saw it. Times are seconds from the soak's start."""

    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    stream: bool
    plan: str  # complete | disconnect | abort
    cut_after: int = 0  # chunks (streamed) or milliseconds (not streamed) before the cut
    outcome: str = "lost"  # completed | errored | aborted | disconnected | lost
    finish_reason: Optional[str] = None
    chunks: int = 0
    usage_tokens: Optional[int] = None
    server_id: Optional[str] = None
    error: Optional[str] = None
    end_s: Optional[float] = None


def cycle(trace: Trace, duration_s: float) -> Iterator[tuple[int, float, TraceRequest]]:
    """(trace index, arrival s, request) for every arrival before ``duration_s``: the trace again
    and again, each pass one trace span (its last arrival plus a mean gap) after the one before."""
    reqs = trace.requests
    span = reqs[-1].arrival_s * len(reqs) / max(1, len(reqs) - 1) if reqs else 0.0
    if not span > 0:
        raise ValueError("the soak cycles the trace's arrival times: this trace has none (give --rate)")
    for n in range(int(duration_s // span) + 1):
        for i, r in enumerate(reqs):
            at = n * span + r.arrival_s
            if at >= duration_s:
                return
            yield i, at, r


class LoadClient:
    """``start()`` the client thread; ``join()`` returns every request's record."""

    def __init__(self, url: str, trace: Trace, prompts: Sequence[list[int]], cfg: SoakConfig, base: float,
                 abort: Callable[[str], None], abort_all: Callable[[], None]):
        self.url, self.trace, self.prompts, self.cfg, self.base = url, trace, prompts, cfg, base
        self._abort, self._abort_all = abort, abort_all
        self.records: list[SoakRecord] = []
        self.num_throttled = 0  # arrivals that waited for a slot (max_in_flight)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="soak-client", daemon=True)
        self._thread.start()

    def join(self) -> list[SoakRecord]:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("the soak's client failed") from self._error
        return self.records

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:  # noqa: BLE001 - surfaced by join()
            self._error = e

    def _now(self) -> float:
        return time.monotonic() - self.base

    async def _run(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        connector = aiohttp.TCPConnector(limit=self.cfg.max_in_flight + 8)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            tasks = await self._send_all(session)
            await self._drain(tasks)

    async def _send_all(self, session) -> list[asyncio.Task]:
        rng = random.Random(self.cfg.seed)
        slots = asyncio.Semaphore(self.cfg.max_in_flight)
        tasks = []
        for n, (i, at, req) in enumerate(cycle(self.trace, self.cfg.duration_s)):
            delay = at - self._now()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots.locked():
                self.num_throttled += 1
            await slots.acquire()
            rec = self._plan(rng, n, req, len(self.prompts[i]))
            self.records.append(rec)
            task = asyncio.create_task(self._one(session, rec, self.prompts[i]))
            task.add_done_callback(lambda _: slots.release())
            tasks.append(task)
        return tasks

    def _plan(self, rng: random.Random, n: int, req: TraceRequest, prompt_tokens: int) -> SoakRecord:
        stream = rng.random() < self.cfg.stream_fraction
        rec = SoakRecord(n, self._now(), prompt_tokens, req.output_tokens, stream, "complete")
        if rng.random() < self.cfg.cut_fraction:
            if stream:
                rec.plan, rec.cut_after = rng.choice(("disconnect", "abort")), rng.randrange(req.output_tokens)
            else:
                rec.plan, rec.cut_after = "disconnect", rng.randrange(NON_STREAM_CUT_MS)
        return rec

    async def _drain(self, tasks: list[asyncio.Task]) -> None:
        """After the duration: requests in flight get ``drain_s`` to end, then the server aborts
        what is left and they get FINAL_S more; whatever has not ended by then is lost."""
        pending = [t for t in tasks if not t.done()]
        if pending:
            _, pending = await asyncio.wait(pending, timeout=self.cfg.drain_s)
        if pending:
            self._abort_all()
            _, pending = await asyncio.wait(pending, timeout=FINAL_S)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)

    # ---- one request ---------------------------------------------------------------------------
    async def _one(self, session, rec: SoakRecord, ids: list[int]) -> None:
        import aiohttp

        body = {"model": "default", "prompt": ids, "max_tokens": rec.max_tokens, "temperature": 0.0,
                "ignore_eos": True}
        try:
            if rec.stream:
                await self._streamed(session, rec, body)
            else:
                await self._answered(session, rec, body)
        except asyncio.CancelledError:
            rec.outcome, rec.error = "lost", f"no end {FINAL_S:g} s after the drain's aborts"
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError, KeyError) as e:
            rec.outcome, rec.error = "lost", f"{type(e).__name__}: {e}"[:300]
        finally:
            rec.end_s = self._now()

    async def _streamed(self, session, rec: SoakRecord, body: dict) -> None:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        asked = False
        async with session.post(self.url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return _http_error(rec, resp.status, await resp.text())
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return _ended(rec)
                _read_chunk(rec, json.loads(data))
                if rec.plan == "disconnect" and rec.chunks > rec.cut_after:
                    rec.outcome = "disconnected"
                    resp.close()  # the connection goes, as a client that went away
                    return
                if rec.plan == "abort" and not asked and rec.chunks > rec.cut_after and rec.server_id:
                    self._abort(rec.server_id)
                    asked = True
        rec.outcome, rec.error = "lost", rec.error or "the stream ended without [DONE]"

    async def _answered(self, session, rec: SoakRecord, body: dict) -> None:
        async def post():
            async with session.post(self.url + "/v1/completions", json=body) as resp:
                return resp.status, await resp.text()

        if rec.plan == "disconnect":
            try:
                status, text = await asyncio.wait_for(post(), rec.cut_after / 1000)
            except asyncio.TimeoutError:
                rec.outcome = "disconnected"
                return
        else:
            status, text = await post()
        if status != 200:
            return _http_error(rec, status, text)
        obj = json.loads(text)
        rec.server_id, rec.chunks = obj.get("id"), 1
        rec.finish_reason = obj["choices"][0]["finish_reason"]
        rec.usage_tokens = (obj.get("usage") or {}).get("completion_tokens")
        _ended(rec)


def _read_chunk(rec: SoakRecord, obj: dict) -> None:
    rec.server_id = rec.server_id or obj.get("id")
    if "error" in obj:
        err = obj["error"]
        rec.outcome, rec.error = "errored", (err.get("message") if isinstance(err, dict) else str(err))[:300]
    for choice in obj.get("choices") or []:
        if choice.get("text"):
            rec.chunks += 1
        rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        rec.usage_tokens = int(usage["completion_tokens"])


def _ended(rec: SoakRecord) -> None:
    """A request that ended cleanly: what its finish says it was."""
    if rec.outcome == "errored":
        return
    outcome = {"length": "completed", "abort": "aborted"}.get(rec.finish_reason)
    if outcome is None:
        rec.outcome, rec.error = "lost", f"ended with finish_reason {rec.finish_reason!r}"
    else:
        rec.outcome = outcome


def _http_error(rec: SoakRecord, status: int, text: str) -> None:
    """An HTTP error is readable when its body is the API's JSON error; anything else is lost."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        rec.outcome, rec.error = "lost", f"HTTP {status} without a JSON error: {text[:200]}"
        return
    rec.outcome, rec.error = "errored", f"HTTP {status}: {message}"[:300]
