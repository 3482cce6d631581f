"""What a request asks the model to continue: chat ``messages``, or completion ``prompt``s.

A completion's ``prompt`` takes the four forms the OpenAI API names: a string, a list of
strings, a list of token ids, or a list of lists of token ids (evaluation harnesses send batches
of token-id prompts). Chat content is a string or a list of text parts.
"""
from __future__ import annotations

from typing import Any, Union

from aserve.api.errors import ApiError, bad, is_int, none_or

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_PROMPTS = 256  # prompts in one completion request

Prompt = Union[str, tuple[int, ...]]

_MESSAGE_NOOPS = {"name": none_or(), "refusal": none_or(), "tool_calls": none_or([]), "function_call": none_or(),
                  "audio": none_or(), "annotations": none_or([])}


def _content(i: int, v: Any) -> str:
    param = f"messages[{i}].content"
    if isinstance(v, str):
        return v
    if not isinstance(v, list) or not v:
        raise bad(param, "a string or a non-empty list of text parts", v)
    texts = []
    for part in v:
        if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"} \
                or not isinstance(part["text"], str):
            raise ApiError(400, f"{param}: only text parts {{\"type\": \"text\", \"text\": ...}} are supported", param)
        texts.append(part["text"])
    return "\n".join(texts)


def _message(i: int, m: Any) -> dict:
    if not isinstance(m, dict):
        raise bad(f"messages[{i}]", "an object", m)
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(f"messages[{i}].role", f"one of {', '.join(ROLES)}", role)
    for key, value in m.items():
        if key in ("role", "content"):
            continue
        if key not in _MESSAGE_NOOPS or not _MESSAGE_NOOPS[key](value):
            raise ApiError(400, f"messages[{i}].{key[:64]} is not supported", f"messages[{i}].{key[:64]}")
    if "content" not in m:
        raise ApiError(400, f"messages[{i}].content is required", f"messages[{i}].content")
    return {"role": ROLES[role], "content": _content(i, m["content"])}


def messages(v: Any) -> tuple[dict, ...]:
    if not isinstance(v, list) or not v:
        raise bad("messages", "a non-empty list of messages", v)
    return tuple(_message(i, m) for i, m in enumerate(v))


def _token_ids(v: list, vocab_size: int) -> tuple[int, ...]:
    if not v or not all(is_int(t) and 0 <= t < vocab_size for t in v):
        raise ApiError(400, f"prompt token ids must be non-empty lists of integers in [0, {vocab_size})", "prompt")
    return tuple(v)


def _text(v: str) -> str:
    if not v:
        raise ApiError(400, "prompt must not be empty", "prompt")
    return v


def prompts(v: Any, vocab_size: int) -> tuple[Prompt, ...]:
    """The completion prompts, each text or token ids, in the order of the choices they get."""
    if isinstance(v, str):
        return (_text(v),)
    if not isinstance(v, list) or not v:
        raise bad("prompt", "a string, a list of strings, a list of token ids or a list of lists of them", v)
    if all(isinstance(x, str) for x in v):
        batch = tuple(_text(x) for x in v)
    elif all(isinstance(x, list) for x in v):
        batch = tuple(_token_ids(x, vocab_size) for x in v)
    elif any(isinstance(x, (str, list)) for x in v):
        raise ApiError(400, "prompt must not mix strings, token ids and lists", "prompt")
    else:
        return (_token_ids(v, vocab_size),)
    if len(batch) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts in one request, got {len(batch)}", "prompt")
    return batch
