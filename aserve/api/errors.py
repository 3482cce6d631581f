"""The API's error (OpenAI-shaped, with its HTTP status) and the small value checks that raise it.

Messages quote at most a short piece of a bad value, never the whole input.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional


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


def short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def bad(param: str, what: str, value: Any) -> ApiError:
    return ApiError(400, f"{param} must be {what}, got {short(value)}", param)


def is_int(v: Any) -> bool:
    return type(v) is int  # bool is an int subclass: true/false are not numbers here


def is_num(v: Any) -> bool:
    return (type(v) is int or type(v) is float) and math.isfinite(v)


def int_in(param: str, v: Any, lo: int, hi: int) -> int:
    if not is_int(v) or not lo <= v <= hi:
        raise bad(param, f"an integer in [{lo}, {hi}]", v)
    return v


def as_bool(param: str, v: Any) -> bool:
    if type(v) is not bool:
        raise bad(param, "a boolean", v)
    return v


def none_or(*ok: Any) -> Callable[[Any], bool]:
    """A check for a value that changes nothing: None or one of ``ok`` (same type and value)."""
    return lambda v: v is None or any(type(v) is type(o) and v == o for o in ok)
