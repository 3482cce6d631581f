"""The answer to a generation request: one JSON object when every choice has ended, or SSE
chunks as tokens come.

    choices' requests --merged events (arrival order)--> Choice.add --> Piece(text, logprobs)
        no stream: {"choices": [...every choice...], "usage"}
        stream:    chat role chunk per choice, a chunk per piece, a finish chunk per choice,
                   usage (stream_options.include_usage), data: [DONE]

With ``continuous_usage_stats`` every chunk carries its choice's usage so far (vLLM's extension,
which guidellm asks for); with ``include_usage`` alone chunks carry ``"usage": null`` and the
totals come last, in a chunk with no choices.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator, Optional

from aiohttp import web

from aserve.api.choices import Choice, Piece, total_usage
from aserve.api.context import ServeContext
from aserve.api.errors import ApiError
from aserve.api.validate import GenerationRequest
from aserve.cluster.requests import TokenEvent


def _engine_error(message: Optional[str]) -> ApiError:
    return ApiError(500, f"the engine failed this request: {message or 'unknown error'}", type_="server_error")


async def _events(ctx: ServeContext, choices: list[Choice]) -> AsyncIterator[tuple[Choice, TokenEvent]]:
    """Every choice's events, merged in the order they arrive, until each choice has ended."""
    if len(choices) == 1:
        async for ev in ctx.cluster.stream(choices[0].handle):
            yield choices[0], ev
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        async for ev in ctx.cluster.stream(c.handle):
            queue.put_nowait((c, ev))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        left = len(choices)
        while left:
            c, ev = await queue.get()
            left -= ev.finished
            yield c, ev
    finally:
        for t in tasks:
            t.cancel()


async def complete(ctx: ServeContext, req: GenerationRequest, response_id: str,
                   choices: list[Choice]) -> web.Response:
    texts = {c.index: [] for c in choices}
    async with contextlib.aclosing(_events(ctx, choices)) as events:
        async for c, ev in events:
            texts[c.index].append(c.add(ev).text)
            if ev.finished and ev.error:
                raise _engine_error(ev.error)
    out = []
    for c in choices:
        text = "".join(texts[c.index])
        if req.kind == "chat":
            out.append({"index": c.index, "message": {"role": "assistant", "content": text},
                        "logprobs": c.all_logprobs(), "finish_reason": c.finish_reason})
        else:
            out.append({"index": c.index, "text": text, "logprobs": c.all_logprobs(), "finish_reason": c.finish_reason})
    return web.json_response({"id": response_id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
                              "created": int(time.time()), "model": ctx.served_name, "choices": out,
                              "usage": total_usage(choices, req.n)})


class _Chunks:
    """Builds one response's SSE chunks (``data: {...}``) in the shape of its endpoint."""

    def __init__(self, ctx: ServeContext, req: GenerationRequest, response_id: str):
        self.req = req
        self.head = {"id": response_id, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
                     "created": int(time.time()), "model": ctx.served_name}

    def choice(self, c: Choice, piece: Piece, finish_reason: Optional[str] = None, role: bool = False) -> bytes:
        if self.req.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": piece.text} if piece.text else {})
            choice = {"index": c.index, "delta": delta, "logprobs": piece.logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": c.index, "text": piece.text, "logprobs": piece.logprobs, "finish_reason": finish_reason}
        extra = {}
        if self.req.continuous_usage:
            extra = {"usage": c.usage()}
        elif self.req.include_usage:
            extra = {"usage": None}
        return sse({**self.head, "choices": [choice], **extra})

    def usage(self, choices: list[Choice]) -> bytes:
        return sse({**self.head, "choices": [], "usage": total_usage(choices, self.req.n)})


# Characters JSON leaves raw that line readers built on str.splitlines (httpx's aiter_lines, so
# guidellm's client) take for line ends: a sampled token holding one cut its event in two
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict) -> bytes:
    """One server-sent event: ``data: <json>`` on one line. Only CR and LF end a line in the
    SSE grammar, but clients that split with str.splitlines also end one at NEL, U+2028 and
    U+2029, which JSON may leave raw in a string: they go escaped (the same JSON)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS).encode() + b"\n\n"


def _has_tokens(logprobs: Optional[dict]) -> bool:
    return bool(logprobs and (logprobs.get("content") or logprobs.get("tokens")))


async def stream(ctx: ServeContext, request: web.Request, req: GenerationRequest, response_id: str,
                 choices: list[Choice]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    chunks = _Chunks(ctx, req, response_id)
    try:
        # A chat choice's role chunk goes out with its first event (its first token, or its end),
        # not before the prefill: clients that time the first chunk (vllm bench serve) would
        # otherwise read the time to the response headers as TTFT. vLLM sends it the same way.
        unannounced = {id(c) for c in choices} if req.kind == "chat" else set()
        async with contextlib.aclosing(_events(ctx, choices)) as events:
            async for c, ev in events:
                if id(c) in unannounced:
                    unannounced.discard(id(c))
                    await resp.write(chunks.choice(c, Piece(), role=True))
                piece = c.add(ev)
                if piece.text or _has_tokens(piece.logprobs):
                    await resp.write(chunks.choice(c, piece))
                if ev.finished and ev.error:
                    await resp.write(sse(_engine_error(ev.error).body()))
                elif ev.finished:
                    await resp.write(chunks.choice(c, Piece(), c.finish_reason))
        if req.include_usage:
            await resp.write(chunks.usage(choices))
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionError:
        pass  # the client went away; the caller's finally aborts the requests
    return resp
