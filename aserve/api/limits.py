"""What one request may cost, checked before any of it enters the cluster.

    max_tokens of each choice   the request's, at most --max-tokens (400 past it); without one: 16
                                (completions) or what fits (chat), within --max-tokens and an even
                                share of --max-request-tokens per choice
    prompt + max_tokens         within the model's context and the smallest instance's KV pool
    n x (prompt + max_tokens)   summed over the prompts, within --max-request-tokens (400)
    logprobs in the response    choices x (echoed prompt + max_tokens) x (k + 1), within
                                --max-logprob-entries (400)
    choices waiting             those already waiting for their first token plus this request's
                                n x prompts, within --max-queued-requests (429, Retry-After)

Every refusal is an OpenAI-shaped error that names the limit and the flag that raises it. A
request that could never fit (more choices than the queue holds) is a 400, not a 429.
"""
from __future__ import annotations

from aserve.api.context import ServeContext, ServerSettings
from aserve.api.errors import ApiError
from aserve.api.validate import GenerationRequest
from aserve.cluster.snapshot import num_waiting_requests

COMPLETION_DEFAULT = 16  # OpenAI's legacy default for /v1/completions


def fit_max_tokens(ctx: ServeContext, req: GenerationRequest, prompt_lens: list[int]) -> list[int]:
    """Each prompt's max_tokens (the request's, or the default), checked against every limit."""
    share = ctx.settings.max_request_tokens // req.num_choices  # a default keeps each choice within it
    max_tokens = [_fit(ctx, req, n, share) for n in prompt_lens]
    _check_budget(ctx.settings, req, prompt_lens, max_tokens)
    _check_logprobs(ctx.settings, req, prompt_lens, max_tokens)
    return max_tokens


def _fit(ctx: ServeContext, req: GenerationRequest, num_prompt: int, share: int) -> int:
    """max_tokens for one prompt; 400 when prompt + output cannot fit. Two limits of the engine:
    the model's context window, and the smallest instance KV pool (a request that outgrows every
    pool would be preempted forever); one of the server: ``--max-tokens``. ``max_tokens: 0``
    (echo) still samples one token, which is not returned."""
    context, cap = ctx.cluster.bundle.args.max_position, ctx.settings.max_tokens
    room = min(context, ctx.pool_tokens) - num_prompt
    if req.max_tokens is None:
        if room < 1:
            if ctx.pool_tokens < context:
                raise _too_long(req, num_prompt, 1, ctx.pool_tokens, what="the KV cache of an instance")
            raise _too_long(req, num_prompt, 1, context)
        default = min(room, COMPLETION_DEFAULT) if req.kind == "completion" else room
        if cap is not None:
            default = min(default, cap)
        return max(1, min(default, share - num_prompt))  # past the share: the budget check refuses it
    if cap is not None and req.max_tokens > cap:
        raise ApiError(400, f"max_tokens is {req.max_tokens}; this server generates at most {cap} tokens a choice "
                            "(--max-tokens)", "max_tokens", code="max_tokens_exceeded")
    want = max(req.max_tokens, 1)
    if num_prompt + want > context:
        raise _too_long(req, num_prompt, want, context)
    if num_prompt + want > ctx.pool_tokens:
        raise _too_long(req, num_prompt, want, ctx.pool_tokens, what="the KV cache of an instance")
    return want


def _too_long(req: GenerationRequest, num_prompt: int, max_tokens: int, limit: int,
              what: str = "this model's maximum context length") -> ApiError:
    return ApiError(400, f"{what} is {limit} tokens; you requested {num_prompt + max_tokens} tokens "
                         f"({num_prompt} in the {req.prompt_param}, {max_tokens} in the completion)",
                    req.prompt_param, code="context_length_exceeded")


def _check_budget(settings: ServerSettings, req: GenerationRequest, prompt_lens: list[int],
                  max_tokens: list[int]) -> None:
    need = req.n * sum(p + m for p, m in zip(prompt_lens, max_tokens))
    limit = settings.max_request_tokens
    if need > limit:
        where = "max_tokens" if req.max_tokens is not None else "n" if req.num_choices > 1 else req.prompt_param
        raise ApiError(400, f"this request may compute {need} tokens: n ({req.n}) x (prompt + max_tokens) over "
                            f"{len(prompt_lens)} prompt(s) of {sum(prompt_lens)} tokens with max_tokens "
                            f"{max(max_tokens)}; this server takes at most {limit} tokens a request "
                            "(--max-request-tokens)", where, code="request_too_large")


def _check_logprobs(settings: ServerSettings, req: GenerationRequest, prompt_lens: list[int],
                    max_tokens: list[int]) -> None:
    if req.logprobs is None:
        return
    generated = 0 if req.max_tokens == 0 else 1  # echo with max_tokens 0 returns no completion token
    positions = sum((p if req.echo else 0) + generated * m for p, m in zip(prompt_lens, max_tokens))
    entries = req.n * positions * (req.logprobs + 1)
    limit = settings.max_logprob_entries
    if entries > limit:
        raise ApiError(400, f"this response would carry {entries} logprobs: {req.num_choices} choice(s) x "
                            f"{'the echoed prompt plus ' if req.echo else ''}max_tokens x {req.logprobs + 1} "
                            f"(logprobs + 1); this server returns at most {limit} (--max-logprob-entries)",
                       "logprobs", code="logprobs_too_large")


def check_queue(ctx: ServeContext, req: GenerationRequest) -> None:
    """The back-pressure check, for the whole request at once (its submits follow with no await)."""
    limit = ctx.settings.max_queued_requests
    if not limit:
        return
    if req.num_choices > limit:
        raise ApiError(400, f"{req.num_choices} choices (n x prompts) in one request; at most {limit} may wait "
                            "at once (--max-queued-requests)", "n", code="too_many_choices")
    waiting = num_waiting_requests(ctx.cluster)
    if waiting + req.num_choices > limit:
        raise ApiError(429, f"too many requests waiting: {waiting} choices wait for their first token and this "
                            f"request adds {req.num_choices}; at most {limit} (--max-queued-requests); retry later",
                       type_="rate_limit_error", code="too_many_requests", headers={"Retry-After": "1"})
