"""Request bodies of the OpenAI-compatible API, read (``read_body``) and checked into a frozen
``GenerationRequest``.

Every key is either used, accepted because its value is a no-op (``n: 1``,
``presence_penalty: 0``, ``tools: []``, ... as some clients send by default), or refused with a
400 that names it: a parameter the server cannot honour is never silently ignored. Messages
quote at most a short piece of a bad value, never the whole input.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from aiohttp import web

from scheduling.request import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Below this temperature sampling degenerates (logits / T overflows): treat it as greedy.
GREEDY_EPS = 1e-5
# A smaller top_p can round to 0 in float32, where the sampler would drop every token; this one
# already keeps only the most likely token, which is what any smaller top_p means.
MIN_TOP_P = 1e-6
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request. ``prompt`` is text or token ids (completions); ``messages`` is chat."""

    kind: str  # "chat" | "completion"
    model: str
    prompt: Union[str, tuple[int, ...], None] = None
    messages: Optional[tuple[dict, ...]] = None
    max_tokens: Optional[int] = None  # None: as many as the context and the KV pool allow
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def sampling(self, max_tokens: int) -> SamplingParams:
        temperature = 0.0 if self.temperature < GREEDY_EPS else self.temperature
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=max(self.top_p, MIN_TOP_P),
                              top_k=self.top_k, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos)


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


# ---- small type checks ------------------------------------------------------------------------
def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(param: str, what: str, value: Any) -> ApiError:
    return ApiError(400, f"{param} must be {what}, got {_short(value)}", param)


def _is_int(v: Any) -> bool:
    return type(v) is int  # bool is an int subclass: true/false are not numbers here


def _is_num(v: Any) -> bool:
    return (type(v) is int or type(v) is float) and math.isfinite(v)


def _int_in(param: str, v: Any, lo: int, hi: int) -> int:
    if not _is_int(v) or not lo <= v <= hi:
        raise _bad(param, f"an integer in [{lo}, {hi}]", v)
    return v


def _bool(param: str, v: Any) -> bool:
    if type(v) is not bool:
        raise _bad(param, "a boolean", v)
    return v


# ---- parameters --------------------------------------------------------------------------------
def _temperature(v: Any) -> float:
    if not _is_num(v) or not 0 <= v <= 2:
        raise _bad("temperature", "a number in [0, 2]", v)
    return float(v)


def _top_p(v: Any) -> float:
    if not _is_num(v) or not 0 < v <= 1:
        raise _bad("top_p", "a number in (0, 1]", v)
    return float(v)


def _top_k(v: Any) -> int:
    return max(0, _int_in("top_k", v, -1, 2**31 - 1))  # -1 and 0 both mean "off"


def _stop(v: Any) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS:
        raise _bad("stop", f"a string or a list of at most {MAX_STOP_STRINGS} strings", v)
    for s in items:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise _bad("stop", f"non-empty strings of at most {MAX_STOP_CHARS} characters", s)
    return tuple(items)


def _stream_options(v: Any) -> bool:
    if not isinstance(v, dict):
        raise _bad("stream_options", "an object", v)
    for key in v:
        if key != "include_usage":
            raise ApiError(400, f"stream_options.{_short(key)} is not supported", "stream_options")
    return _bool("stream_options.include_usage", v.get("include_usage", False))


# Values that change nothing, as clients send them by default; anything else is refused.
def _none_or(*ok: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(type(v) is type(o) and v == o for o in ok)


NOOPS_COMMON = {
    "n": _none_or(1), "presence_penalty": _none_or(0, 0.0), "frequency_penalty": _none_or(0, 0.0),
    "logit_bias": _none_or({}), "user": lambda v: v is None or isinstance(v, str),
}
NOOPS_CHAT = {
    "logprobs": _none_or(False), "top_logprobs": _none_or(0), "tools": _none_or([]), "tool_choice": _none_or("none"),
    "parallel_tool_calls": _none_or(), "functions": _none_or([]), "function_call": _none_or("none"),
    "response_format": _none_or({"type": "text"}), "store": _none_or(False), "metadata": _none_or({}),
    "modalities": _none_or(["text"]), "service_tier": _none_or("auto"), "reasoning_effort": _none_or(),
    "audio": _none_or(), "prediction": _none_or(), "web_search_options": _none_or(),
}
NOOPS_COMPLETION = {"logprobs": _none_or(), "echo": _none_or(False), "suffix": _none_or(""), "best_of": _none_or(1)}
USED_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "stream",
               "stream_options"}
USED = {"chat": USED_COMMON | {"messages", "max_completion_tokens"}, "completion": USED_COMMON | {"prompt"}}


def _check_keys(kind: str, body: dict) -> None:
    noops = {**NOOPS_COMMON, **(NOOPS_CHAT if kind == "chat" else NOOPS_COMPLETION)}
    for key, value in body.items():
        if key in USED[kind]:
            continue
        if key not in noops:
            raise ApiError(400, f"Unrecognized request argument supplied: {_short(key)}", key[:64])
        if not noops[key](value):
            raise ApiError(400, f"{key} is not supported by this server (only its default value is accepted)", key)


# ---- prompts -----------------------------------------------------------------------------------
_MESSAGE_NOOPS = {"name": _none_or(), "refusal": _none_or(), "tool_calls": _none_or([]), "function_call": _none_or(),
                  "audio": _none_or(), "annotations": _none_or([])}


def _content(i: int, v: Any) -> str:
    param = f"messages[{i}].content"
    if isinstance(v, str):
        return v
    if not isinstance(v, list) or not v:
        raise _bad(param, "a string or a non-empty list of text parts", v)
    texts = []
    for part in v:
        if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"} \
                or not isinstance(part["text"], str):
            raise ApiError(400, f"{param}: only text parts {{\"type\": \"text\", \"text\": ...}} are supported", param)
        texts.append(part["text"])
    return "\n".join(texts)


def _message(i: int, m: Any) -> dict:
    if not isinstance(m, dict):
        raise _bad(f"messages[{i}]", "an object", m)
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise _bad(f"messages[{i}].role", f"one of {', '.join(ROLES)}", role)
    for key, value in m.items():
        if key in ("role", "content"):
            continue
        if key not in _MESSAGE_NOOPS or not _MESSAGE_NOOPS[key](value):
            raise ApiError(400, f"messages[{i}].{key[:64]} is not supported", f"messages[{i}].{key[:64]}")
    if "content" not in m:
        raise ApiError(400, f"messages[{i}].content is required", f"messages[{i}].content")
    return {"role": ROLES[role], "content": _content(i, m["content"])}


def _messages(v: Any) -> tuple[dict, ...]:
    if not isinstance(v, list) or not v:
        raise _bad("messages", "a non-empty list of messages", v)
    return tuple(_message(i, m) for i, m in enumerate(v))


def _token_ids(v: list, vocab_size: int) -> tuple[int, ...]:
    if not v or not all(_is_int(t) and 0 <= t < vocab_size for t in v):
        raise ApiError(400, f"prompt token ids must be integers in [0, {vocab_size})", "prompt")
    return tuple(v)


def _prompt(v: Any, vocab_size: int) -> Union[str, tuple[int, ...]]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        if not v:
            raise ApiError(400, "prompt must not be empty", "prompt")
        return v
    if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
        raise ApiError(400, "only one prompt per request is supported", "prompt")
    if isinstance(v, list):
        return _token_ids(v, vocab_size)
    raise _bad("prompt", "a string or a list of token ids", v)


# ---- the whole body ----------------------------------------------------------------------------
def _max_tokens(body: dict) -> Optional[int]:
    values = {k: _int_in(k, body[k], 1, 2**31 - 1) for k in ("max_tokens", "max_completion_tokens")
              if body.get(k) is not None}
    if len(set(values.values())) > 1:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree; give one", "max_tokens")
    return next(iter(values.values()), None)


def _get(body: dict, key: str, check: Callable[[Any], Any], default: Any) -> Any:
    value = body.get(key)
    return default if value is None else check(value)


def validate(kind: str, body: dict, vocab_size: int) -> GenerationRequest:
    """Check a parsed body of ``/v1/chat/completions`` (``kind="chat"``) or ``/v1/completions``."""
    assert kind in USED, kind
    _check_keys(kind, body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "a model name", model)
    if kind == "chat":
        if "messages" not in body:
            raise ApiError(400, "messages is required", "messages")
        source = {"messages": _messages(body["messages"])}
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", "prompt")
        source = {"prompt": _prompt(body["prompt"], vocab_size)}
    stream = _get(body, "stream", lambda v: _bool("stream", v), False)
    include_usage = _get(body, "stream_options", _stream_options, False)
    if body.get("stream_options") is not None and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    return GenerationRequest(
        kind, model, **source, max_tokens=_max_tokens(body),
        temperature=_get(body, "temperature", _temperature, 1.0), top_p=_get(body, "top_p", _top_p, 1.0),
        top_k=_get(body, "top_k", _top_k, 0), seed=_get(body, "seed", lambda v: _int_in("seed", v, -2**63, 2**64 - 1), None),
        stop=_get(body, "stop", _stop, ()), ignore_eos=_get(body, "ignore_eos", lambda v: _bool("ignore_eos", v), False),
        stream=stream, include_usage=include_usage)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The raw body, or 413 when it is larger than ``limit`` (declared or actual)."""
    too_big = ApiError(413, f"request body larger than {limit} bytes", None, code="request_too_large")
    if request.content_length is not None and request.content_length > limit:
        raise too_big
    try:
        return await request.read()  # the app's client_max_size enforces the limit on chunked bodies
    except web.HTTPRequestEntityTooLarge:
        raise too_big from None
