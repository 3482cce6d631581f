"""``POST /v1/chat/completions`` and ``POST /v1/completions``: check, tokenise, submit, answer.

    body --validate--> GenerationRequest --tokenise (own thread)--> ids --fits?--> cluster.submit
         stream:   SSE chunks as tokens come (IncrementalDetokenizer), usage, [DONE]
         no stream: one JSON object when the request ends

Whatever way a handler ends (finished, client gone, handler cancelled by aiohttp, write error,
shutdown), its ``finally`` aborts the request if it is still in the cluster, so its blocks are
freed everywhere, and records the request's latencies.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Optional

from aiohttp import web

from aserve.api.context import ServeContext
from aserve.api.detok import IncrementalDetokenizer
from aserve.api.validate import ApiError, GenerationRequest, parse_json, read_body, validate
from aserve.cluster.requests import RequestHandle
from aserve.cluster.snapshot import num_waiting_requests
from aserve.engine.bundle import PromptTooLong


def _refuse_if_draining(ctx: ServeContext) -> None:
    if ctx.draining:
        raise ApiError(503, "the server is shutting down", type_="server_unavailable", code="draining")


async def generate(ctx: ServeContext, request: web.Request, kind: str) -> web.StreamResponse:
    _refuse_if_draining(ctx)
    body = parse_json(await read_body(request, ctx.settings.max_body_bytes))
    req = validate(kind, body, ctx.cluster.bundle.args.vocab_size)
    if req.model not in ctx.model_names:
        raise ApiError(404, f"The model {req.model[:64]!r} does not exist", "model", code="model_not_found")
    ids = await _tokenise(ctx, req)
    max_tokens = _fit(ctx, req, len(ids))
    handle = _submit(ctx, req, ids, max_tokens)
    ctx.num_active += 1
    try:
        if req.stream:
            return await _stream(ctx, request, req, handle)
        return await _complete(ctx, req, handle)
    finally:
        ctx.num_active -= 1
        if handle.phase != "done":  # client gone, handler cancelled, write failed: free its blocks
            ctx.cluster.abort(handle.request.request_id)
        ctx.metrics.observe(handle)


async def _tokenise(ctx: ServeContext, req: GenerationRequest) -> list[int]:
    """Prompt token ids, on the tokeniser's own thread (a long prompt must not stall the loop)."""
    if isinstance(req.prompt, tuple):
        return list(req.prompt)
    source = list(req.messages) if req.kind == "chat" else req.prompt
    loop = asyncio.get_running_loop()
    try:
        ids = await loop.run_in_executor(ctx.tokenizer_pool, ctx.cluster.bundle.encode, source)
    except Exception as e:  # a chat template may refuse a conversation (e.g. role order)
        raise ApiError(400, f"could not apply the chat template: {str(e)[:200]}", req.prompt_param) from None
    if not ids:
        raise ApiError(400, f"{req.prompt_param} encodes to no tokens", req.prompt_param)
    return ids


def _fit(ctx: ServeContext, req: GenerationRequest, num_prompt: int) -> int:
    """max_tokens to use: the request's, or a default; 400 when prompt + output cannot fit.

    Two limits: the model's context window, and the smallest instance KV pool (a request that
    outgrows every pool would be preempted forever). Default: 16 for completions (OpenAI's
    legacy default), everything that fits for chat.
    """
    context = ctx.cluster.bundle.args.max_position
    room = min(context, ctx.pool_tokens) - num_prompt
    if req.max_tokens is None:
        if room < 1:
            raise _too_long(req, num_prompt, 1, min(context, ctx.pool_tokens))
        return min(room, 16) if req.kind == "completion" else room
    if num_prompt + req.max_tokens > context:
        raise _too_long(req, num_prompt, req.max_tokens, context)
    if num_prompt + req.max_tokens > ctx.pool_tokens:
        raise _too_long(req, num_prompt, req.max_tokens, ctx.pool_tokens, what="the KV cache of an instance")
    return req.max_tokens


def _too_long(req: GenerationRequest, num_prompt: int, max_tokens: int, limit: int,
              what: str = "this model's maximum context length") -> ApiError:
    return ApiError(400, f"{what} is {limit} tokens; you requested {num_prompt + max_tokens} tokens "
                         f"({num_prompt} in the {req.prompt_param}, {max_tokens} in the completion)",
                    req.prompt_param, code="context_length_exceeded")


def _submit(ctx: ServeContext, req: GenerationRequest, ids: list[int], max_tokens: int) -> RequestHandle:
    """Back-pressure check and submit, with no await in between (the count stays true)."""
    _refuse_if_draining(ctx)  # again: shutdown may have begun while the prompt was tokenised
    limit = ctx.settings.max_queued_requests
    if limit and num_waiting_requests(ctx.cluster) >= limit:
        raise ApiError(429, f"too many requests waiting (limit {limit}); retry later", type_="rate_limit_error",
                       code="too_many_requests", headers={"Retry-After": "1"})
    rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    prompt_text = req.prompt if isinstance(req.prompt, str) else ""
    try:
        return ctx.cluster.submit(ids, req.sampling(max_tokens), request_id=rid, prompt_text=prompt_text)
    except (PromptTooLong, ValueError) as e:
        ctx.cluster.abort(rid)  # submit may have entered it in the table before refusing it
        raise ApiError(400, str(e)[:300], req.prompt_param, code="context_length_exceeded") from None


# ---- answers --------------------------------------------------------------------------------------
def _usage(handle: RequestHandle) -> dict:
    r = handle.request
    return {"prompt_tokens": r.num_prompt_tokens, "completion_tokens": r.num_output_tokens,
            "total_tokens": r.num_prompt_tokens + r.num_output_tokens}


def _engine_error(message: Optional[str]) -> ApiError:
    return ApiError(500, f"the engine failed this request: {message or 'unknown error'}", type_="server_error")


async def _complete(ctx: ServeContext, req: GenerationRequest, handle: RequestHandle) -> web.Response:
    detok = IncrementalDetokenizer(ctx.cluster.bundle.tokenizer, req.stop)
    parts, last = [], None
    async for ev in ctx.cluster.stream(handle):
        if ev.token_id is not None:
            parts.append(detok.add(ev.token_id))
        last = ev
    if last.error:
        raise _engine_error(last.error)
    text = "".join(parts) + detok.finish()
    rid, created = handle.request.request_id, int(time.time())
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": last.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        obj = "text_completion"
    return web.json_response({"id": rid, "object": obj, "created": created, "model": ctx.served_name,
                              "choices": [choice], "usage": _usage(handle)})


class _Chunks:
    """Builds one request's SSE chunks (``data: {...}``) in the shape of its endpoint."""

    def __init__(self, ctx: ServeContext, req: GenerationRequest, handle: RequestHandle):
        self.req, self.handle = req, handle
        self.head = {"id": handle.request.request_id,
                     "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
                     "created": int(time.time()), "model": ctx.served_name}

    def choice(self, text: Optional[str], finish_reason: Optional[str] = None, role: bool = False) -> bytes:
        if self.req.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        extra = {"usage": None} if self.req.include_usage else {}
        return sse({**self.head, "choices": [choice], **extra})

    def usage(self) -> bytes:
        return sse({**self.head, "choices": [], "usage": _usage(self.handle)})


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _stream(ctx: ServeContext, request: web.Request, req: GenerationRequest,
                  handle: RequestHandle) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    chunks = _Chunks(ctx, req, handle)
    detok = IncrementalDetokenizer(ctx.cluster.bundle.tokenizer, req.stop)
    try:
        if req.kind == "chat":
            await resp.write(chunks.choice(None, role=True))
        async for ev in ctx.cluster.stream(handle):
            text = detok.add(ev.token_id) if ev.token_id is not None else ""
            if ev.finished:
                text += detok.finish()
            if text:
                await resp.write(chunks.choice(text))
            if ev.finished and ev.error:
                await resp.write(sse(_engine_error(ev.error).body()))
            elif ev.finished:
                await resp.write(chunks.choice(None, ev.finish_reason))
        if req.include_usage:
            await resp.write(chunks.usage())
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionError:
        pass  # the client went away; the caller's finally aborts the request
    return resp
