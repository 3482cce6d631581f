"""Request bodies of the OpenAI-compatible API, read (``read_body``) and checked into a frozen
``GenerationRequest``.

Every key is either used, accepted because its value is a no-op (``presence_penalty: 0``,
``tools: []``, ... as clients send by default), or refused with a 400 that names it: a parameter
the server cannot honour is never silently ignored. What the common clients send (the openai
SDK, LangChain, guidellm, aiperf, vLLM's benchmark; their recorded bodies are in
tests/data/clients/) is honoured, including vLLM's extensions they use (``ignore_eos``,
``top_k``, ``stream_options.continuous_usage_stats``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

from aiohttp import web

from aserve.api.errors import ApiError, as_bool, bad, int_in, is_num, none_or, short
from aserve.api.prompts import Prompt, messages, prompts
from scheduling.request import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's chat limit; vLLM's default max_logprobs)
MAX_SALT_CHARS = 1024  # cache_salt: it names a tenant, not a payload
MAX_CHOICES = 256  # choices in one response: n x the number of prompts
# Below this temperature sampling degenerates (logits / T overflows): treat it as greedy.
GREEDY_EPS = 1e-5
# A smaller top_p can round to 0 in float32, where the sampler would drop every token; this one
# already keeps only the most likely token, which is what any smaller top_p means.
MIN_TOP_P = 1e-6


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: ``prompts`` (completions: text or token ids each) or ``messages`` (chat).

    It becomes ``num_choices`` requests in the cluster: ``n`` for each prompt, choice
    ``prompt_index * n + j`` (the OpenAI API's order)."""

    kind: str  # "chat" | "completion"
    model: str
    prompts: tuple[Prompt, ...] = ()
    messages: Optional[tuple[dict, ...]] = None
    max_tokens: Optional[int] = None  # None: as many as fit; 0 (completions with echo): score the prompt only
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage on every chunk (vLLM's stream_options.continuous_usage_stats)
    n: int = 1
    logprobs: Optional[int] = None  # top logprobs per token; None: no logprobs
    echo: bool = False  # completions: the prompt comes back before the completion (with logprobs if asked)
    # prefix caching (vLLM's field): requests share cached KV blocks only with requests of the same salt
    cache_salt: Optional[str] = None

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    @property
    def num_choices(self) -> int:
        return self.n * (1 if self.kind == "chat" else len(self.prompts))

    def sampling(self, max_tokens: int, j: int = 0) -> SamplingParams:
        """Choice ``j`` of ``n``: a seeded request's choices draw from seeds ``seed + j``, so they
        differ and choice 0 is what ``n: 1`` gives."""
        temperature = 0.0 if self.temperature < GREEDY_EPS else self.temperature
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=max(self.top_p, MIN_TOP_P),
                              top_k=self.top_k, seed=None if self.seed is None else self.seed + j, stop=self.stop,
                              ignore_eos=self.ignore_eos, logprobs=self.logprobs,
                              prompt_logprobs=self.logprobs if self.echo else None)


# ---- JSON --------------------------------------------------------------------------------------
def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; NaN/Infinity, bad UTF-8 and deep nesting are 400s."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        detail = "body is not UTF-8" if isinstance(e, UnicodeDecodeError) else "body is not valid JSON"
        raise ApiError(400, f"We could not parse the JSON body of your request: {detail}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


# ---- parameters --------------------------------------------------------------------------------
def _temperature(v: Any) -> float:
    if not is_num(v) or not 0 <= v <= 2:
        raise bad("temperature", "a number in [0, 2]", v)
    return float(v)


def _top_p(v: Any) -> float:
    if not is_num(v) or not 0 < v <= 1:
        raise bad("top_p", "a number in (0, 1]", v)
    return float(v)


def _top_k(v: Any) -> int:
    return max(0, int_in("top_k", v, -1, 2**31 - 1))  # -1 and 0 both mean "off"


def _stop(v: Any) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS:
        raise bad("stop", f"a string or a list of at most {MAX_STOP_STRINGS} strings", v)
    for s in items:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise bad("stop", f"non-empty strings of at most {MAX_STOP_CHARS} characters", s)
    return tuple(items)


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def _stream_options(v: Any) -> tuple[bool, bool]:
    """(include_usage, continuous): usage on every chunk only with include_usage, as in vLLM."""
    if not isinstance(v, dict):
        raise bad("stream_options", "an object", v)
    for key in v:
        if key not in STREAM_OPTIONS:
            raise ApiError(400, f"stream_options.{short(key)} is not supported", "stream_options")
    flags = [as_bool(f"stream_options.{k}", v[k]) if v.get(k) is not None else False for k in STREAM_OPTIONS]
    return flags[0], flags[0] and flags[1]


def _logprobs(kind: str, body: dict) -> Optional[int]:
    """Top logprobs per token, or None. Chat: ``logprobs: true`` with ``top_logprobs`` k;
    completions: ``logprobs`` k."""
    top = lambda key: int_in(key, body[key], 0, MAX_LOGPROBS) if body.get(key) is not None else None  # noqa: E731
    if kind == "completion":
        return top("logprobs")
    wanted = as_bool("logprobs", body["logprobs"]) if body.get("logprobs") is not None else False
    k = top("top_logprobs")
    if k and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (k or 0) if wanted else None


# Values that change nothing, as clients send them by default; anything else is refused.
NOOPS_COMMON = {
    "presence_penalty": none_or(0, 0.0), "frequency_penalty": none_or(0, 0.0),
    "logit_bias": none_or({}), "user": lambda v: v is None or isinstance(v, str),
    "repetition_penalty": none_or(1, 1.0),  # vLLM's; vllm bench serve sends 1.0 (off)
}
NOOPS_CHAT = {
    "tools": none_or([]), "tool_choice": none_or("none"),
    "parallel_tool_calls": none_or(), "functions": none_or([]), "function_call": none_or("none"),
    "response_format": none_or({"type": "text"}), "store": none_or(False), "metadata": none_or({}),
    "modalities": none_or(["text"]), "service_tier": none_or("auto"), "reasoning_effort": none_or(),
    "audio": none_or(), "prediction": none_or(), "web_search_options": none_or(),
}
NOOPS_COMPLETION = {"suffix": none_or(""), "best_of": none_or(1)}
USED_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "stream",
               "stream_options", "n", "logprobs", "cache_salt"}
USED = {"chat": USED_COMMON | {"messages", "max_completion_tokens", "top_logprobs"},
        "completion": USED_COMMON | {"prompt", "echo"}}


def _check_keys(kind: str, body: dict) -> None:
    noops = {**NOOPS_COMMON, **(NOOPS_CHAT if kind == "chat" else NOOPS_COMPLETION)}
    for key, value in body.items():
        if key in USED[kind]:
            continue
        if key not in noops:
            raise ApiError(400, f"Unrecognized request argument supplied: {short(key)}", key[:64])
        if not noops[key](value):
            raise ApiError(400, f"{key} is not supported by this server (only its default value is accepted)", key)


# ---- the whole body ----------------------------------------------------------------------------
def _cache_salt(v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_SALT_CHARS:
        raise bad("cache_salt", f"a non-empty string of at most {MAX_SALT_CHARS} characters", v)
    return v


def _max_tokens(body: dict, lo: int) -> Optional[int]:
    values = {k: int_in(k, body[k], lo, 2**31 - 1) for k in ("max_tokens", "max_completion_tokens")
              if body.get(k) is not None}
    if len(set(values.values())) > 1:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree; give one", "max_tokens")
    return next(iter(values.values()), None)


def _get(body: dict, key: str, check: Callable[[Any], Any], default: Any) -> Any:
    value = body.get(key)
    return default if value is None else check(value)


def _source(kind: str, body: dict, vocab_size: int) -> dict:
    key = "messages" if kind == "chat" else "prompt"
    if key not in body:
        raise ApiError(400, f"{key} is required", key)
    return {"messages": messages(body[key])} if kind == "chat" else {"prompts": prompts(body[key], vocab_size)}


def validate(kind: str, body: dict, vocab_size: int) -> GenerationRequest:
    """Check a parsed body of ``/v1/chat/completions`` (``kind="chat"``) or ``/v1/completions``."""
    assert kind in USED, kind
    _check_keys(kind, body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "a model name", model)
    source = _source(kind, body, vocab_size)
    stream = _get(body, "stream", lambda v: as_bool("stream", v), False)
    include_usage, continuous = _get(body, "stream_options", _stream_options, (False, False))
    if body.get("stream_options") is not None and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    echo = kind == "completion" and _get(body, "echo", lambda v: as_bool("echo", v), False)
    req = GenerationRequest(
        kind, model, **source, max_tokens=_max_tokens(body, 0 if echo else 1),
        temperature=_get(body, "temperature", _temperature, 1.0), top_p=_get(body, "top_p", _top_p, 1.0),
        top_k=_get(body, "top_k", _top_k, 0), seed=_get(body, "seed", lambda v: int_in("seed", v, -2**63, 2**64 - 1), None),
        stop=_get(body, "stop", _stop, ()), ignore_eos=_get(body, "ignore_eos", lambda v: as_bool("ignore_eos", v), False),
        stream=stream, include_usage=include_usage, continuous_usage=continuous,
        n=_get(body, "n", lambda v: int_in("n", v, 1, MAX_CHOICES), 1), logprobs=_logprobs(kind, body), echo=echo,
        cache_salt=_get(body, "cache_salt", _cache_salt, None))
    if req.num_choices > MAX_CHOICES:
        raise ApiError(400, f"n x the number of prompts is {req.num_choices}; at most {MAX_CHOICES} choices "
                            "in one request", "n")
    return req


async def read_body(request: web.Request, limit: int) -> bytes:
    """The raw body, or 413 when it is larger than ``limit`` (declared or actual)."""
    too_big = ApiError(413, f"request body larger than {limit} bytes", None, code="request_too_large")
    if request.content_length is not None and request.content_length > limit:
        raise too_big
    try:
        return await request.read()  # the app's client_max_size enforces the limit on chunked bodies
    except web.HTTPRequestEntityTooLarge:
        raise too_big from None
