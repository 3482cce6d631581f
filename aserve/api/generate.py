"""``POST /v1/chat/completions`` and ``POST /v1/completions``: check, tokenise, submit, answer.

    body --validate--> GenerationRequest --tokenise (own thread)--> ids per prompt --limits.py-->
         cluster.submit x num_choices (n per prompt) --> answers.py: one JSON object, or SSE chunks

A prompt's n choices are one ``prefix_group``: the cluster computes the prompt once and the
others start on its KV blocks (aserve/cluster/groups.py), unless they echo the prompt's logprobs.

Whatever way a handler ends (finished, client gone, handler cancelled by aiohttp, write error,
shutdown), its ``finally`` aborts every one of its requests still in the cluster, so their blocks
are freed everywhere, and records each request's latencies.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Optional

from aiohttp import web

from aserve.api.answers import complete, stream
from aserve.api.choices import Choice, TokenText
from aserve.api.context import ServeContext
from aserve.api.errors import ApiError
from aserve.api.limits import check_queue, fit_max_tokens
from aserve.api.validate import GenerationRequest, parse_json, read_body, validate
from aserve.cluster.requests import RequestHandle
from aserve.engine.bundle import PromptTooLong
from scheduling.request import SamplingParams


def _refuse_if_draining(ctx: ServeContext) -> None:
    if ctx.draining:
        raise ApiError(503, "the server is shutting down", type_="server_unavailable", code="draining")


async def generate(ctx: ServeContext, request: web.Request, kind: str) -> web.StreamResponse:
    _refuse_if_draining(ctx)
    body = parse_json(await read_body(request, ctx.settings.max_body_bytes))
    req = validate(kind, body, ctx.cluster.bundle.args.vocab_size)
    if req.model not in ctx.model_names:
        raise ApiError(404, f"The model {req.model[:64]!r} does not exist", "model", code="model_not_found")
    prompt_ids = await _tokenise(ctx, req)
    max_tokens = fit_max_tokens(ctx, req, [len(ids) for ids in prompt_ids])
    response_id, choices = _submit(ctx, req, prompt_ids, max_tokens)
    ctx.num_active += 1
    try:
        if req.stream:
            return await stream(ctx, request, req, response_id, choices)
        return await complete(ctx, req, response_id, choices)
    finally:
        ctx.num_active -= 1
        for c in choices:
            if c.handle.phase != "done":  # client gone, handler cancelled, write failed: free its blocks
                ctx.cluster.abort(c.handle.request.request_id)
            ctx.metrics.observe(c.handle)


async def _tokenise(ctx: ServeContext, req: GenerationRequest) -> list[list[int]]:
    """Each prompt's token ids, on the tokeniser's own thread (long prompts must not stall the loop)."""
    sources = [list(req.messages)] if req.kind == "chat" else list(req.prompts)
    encode = ctx.cluster.bundle.encode
    loop = asyncio.get_running_loop()
    try:
        ids = await loop.run_in_executor(
            ctx.tokenizer_pool, lambda: [list(s) if isinstance(s, tuple) else encode(s) for s in sources])
    except Exception as e:  # a chat template may refuse a conversation (e.g. role order)
        raise ApiError(400, f"could not apply the chat template: {str(e)[:200]}", req.prompt_param) from None
    if not all(ids):
        raise ApiError(400, f"{req.prompt_param} encodes to no tokens", req.prompt_param)
    return ids


def _submit(ctx: ServeContext, req: GenerationRequest, prompt_ids: list[list[int]],
            max_tokens: list[int]) -> tuple[str, list[Choice]]:
    """Back-pressure check and every choice's submit, with no await in between (the count stays
    true); a refusal part-way aborts the choices already in. Returns the response's id and its
    choices (request ids: the response's, or ``id-i`` for choice i of several)."""
    _refuse_if_draining(ctx)  # again: shutdown may have begun while the prompts were tokenised
    check_queue(ctx, req)
    base = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    token_text = TokenText(ctx.cluster.bundle.tokenizer)
    choices: list[Choice] = []
    try:
        for p, ids in enumerate(prompt_ids):
            text = req.prompts[p] if req.kind == "completion" else ""
            if req.echo and not isinstance(text, str):
                text = ctx.cluster.bundle.tokenizer.decode(ids)
            # echo with logprobs scores every prompt row of every choice: nothing to share
            group = f"{base}/{p}" if req.n > 1 and not (req.echo and req.logprobs is not None) else None
            for j in range(req.n):
                rid = base if req.num_choices == 1 else f"{base}-{len(choices)}"
                handle = _submit_one(ctx, req, rid, ids, req.sampling(max_tokens[p], j),
                                     text if isinstance(text, str) else "", group)
                choices.append(Choice(len(choices), req, handle, token_text, text))
    except BaseException:
        for c in choices:
            ctx.cluster.abort(c.handle.request.request_id)
        raise
    return base, choices


def _submit_one(ctx: ServeContext, req: GenerationRequest, rid: str, ids: list[int], sampling: SamplingParams,
                prompt_text: str, group: Optional[str]) -> RequestHandle:
    try:
        return ctx.cluster.submit(ids, sampling, request_id=rid, prompt_text=prompt_text, prefix_group=group,
                                  cache_salt=req.cache_salt)
    except (PromptTooLong, ValueError) as e:
        ctx.cluster.abort(rid)  # submit may have entered it in the table before refusing it
        raise ApiError(400, str(e)[:300], req.prompt_param, code="context_length_exceeded") from None
