"""Trace file formats: each reader turns one file into a ``RawTrace`` of ``TraceRequest``s.

| format   | file   | fields                                                                  |
|----------|--------|-------------------------------------------------------------------------|
| azure    | .csv   | TIMESTAMP (absolute, 7 fractional digits), ContextTokens, GeneratedTokens |
| lengths  | .csv   | num_prefill_tokens, num_decode_tokens (no times: Poisson/Gamma arrivals)  |
| mooncake | .jsonl | timestamp (ms), input_length, output_length, hash_ids                   |
| aserve   | .jsonl | timestamp (s, optional), prompt (text) and/or prompt_tokens, output_tokens; optional hash_ids, hash_block |

``hash_ids`` (Mooncake's, one per 512-token prompt block) name shared prompt prefixes: a replay
gives every block of one id the same tokens (``PromptBuilder``), so prefix caching sees the
reuse the trace recorded. ``read_trace`` detects the format from the extension and the header (CSV) or the first
record's keys (JSONL). Arrivals are seconds relative to the first request. Errors name the
file, the line and the field. Fitting to a run lives in ``aserve.replay.traces``.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator, Optional

from predictors.dataset import iter_jsonl


HASH_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces


class TraceError(ValueError):
    """A trace file that cannot be read: the message names the file, the line and the field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives and how long its prompt and output are."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prompt_text: Optional[str] = None
    # Mooncake's block hashes: block i of the prompt (``hash_block`` tokens each, 512 in Mooncake's
    # traces, the last one partial) holds the same tokens in every request with the same
    # ``hash_ids[i]`` (and the same ids before it): a replay builds shared prefixes from them
    hash_ids: Optional[tuple[int, ...]] = None
    hash_block: int = HASH_BLOCK_TOKENS

    def __post_init__(self):
        if self.arrival_s < 0:
            raise ValueError(f"arrival_s must be >= 0, got {self.arrival_s!r}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"prompt_tokens and output_tokens must be >= 1, got "
                             f"{self.prompt_tokens!r}, {self.output_tokens!r}")


@dataclass(frozen=True)
class RawTrace:
    """What a reader returns: the requests and whether the file carried arrival times."""

    requests: tuple[TraceRequest, ...]
    format: str
    timed: bool


# ---- field helpers ---------------------------------------------------------------------------
def _field(row: dict, name: str, where: str, kind: Callable = int):
    if name not in row or row[name] in (None, ""):
        raise TraceError(f"{where}: missing field {name!r}")
    try:
        value = kind(row[name])
    except (TypeError, ValueError):
        raise TraceError(f"{where}: field {name!r} is not {'an integer' if kind in (int, _int) else 'a number'}: "
                         f"{row[name]!r}") from None
    if value < 0:
        raise TraceError(f"{where}: field {name!r} is negative: {row[name]!r}")
    return value


def _int(value) -> int:
    """Integers, also written as ``12.0`` (some exports do)."""
    f = float(value)
    if f != int(f):
        raise ValueError(value)
    return int(f)


def parse_azure_time(text: str) -> tuple[int, float]:
    """``2023-11-16 18:17:03.9799600`` -> (whole POSIX seconds, fraction). Kept apart because a
    double near 1.7e9 s resolves only ~2e-7 s: subtract whole seconds first to keep all 7 digits."""
    whole, _, frac = text.strip().partition(".")
    if frac and not frac.isdigit():
        raise ValueError(text)
    return int(datetime.fromisoformat(whole).timestamp()), (int(frac) / 10 ** len(frac) if frac else 0.0)


# ---- readers -----------------------------------------------------------------------------------
def _csv_rows(path: Path) -> Iterator[tuple[str, dict]]:
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            yield f"{path}:{i}", row


def read_azure(path: Path) -> RawTrace:
    rows = []
    for where, row in _csv_rows(path):
        if "TIMESTAMP" not in row or not row["TIMESTAMP"]:
            raise TraceError(f"{where}: missing field 'TIMESTAMP'")
        try:
            t = parse_azure_time(row["TIMESTAMP"])
        except ValueError:
            raise TraceError(f"{where}: field 'TIMESTAMP' is not a date-time: {row['TIMESTAMP']!r}") from None
        rows.append((t, _field(row, "ContextTokens", where, _int), _field(row, "GeneratedTokens", where, _int)))
    s0 = min((r[0] for r in rows), default=(0, 0.0))[0]
    return _timed([((t[0] - s0) + t[1], p, o) for t, p, o in rows], "azure")


def read_lengths(path: Path) -> RawTrace:
    reqs = tuple(TraceRequest(0.0, max(1, _field(r, "num_prefill_tokens", w, _int)),
                              max(1, _field(r, "num_decode_tokens", w, _int))) for w, r in _csv_rows(path))
    return RawTrace(reqs, "lengths", timed=False)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
    for i, obj in iter_jsonl(path, TraceError):
        yield f"{path}:{i}", obj


def _hash_ids(row: dict, where: str) -> Optional[tuple[int, ...]]:
    ids = row.get("hash_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(type(h) is int and h >= 0 for h in ids):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integers >= 0")
    return tuple(ids) or None


def read_mooncake(path: Path) -> RawTrace:
    rows = [(_field(r, "timestamp", w, float) / 1000.0, _field(r, "input_length", w, _int),
             _field(r, "output_length", w, _int), None, _hash_ids(r, w)) for w, r in _jsonl_rows(path)]
    return _timed(rows, "mooncake")


def read_aserve(path: Path, count_tokens: Optional[Callable[[str], int]] = None) -> RawTrace:
    """The project's own JSONL (see traces/README.md). Text-only prompts need ``count_tokens``."""
    rows, timed = [], None
    for where, r in _jsonl_rows(path):
        has_time = r.get("timestamp") is not None
        if timed is not None and has_time != timed:
            raise TraceError(f"{where}: field 'timestamp' must be on every line or on none")
        timed = has_time
        text = r.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TraceError(f"{where}: field 'prompt' must be a string")
        if r.get("prompt_tokens") is not None:
            n = _field(r, "prompt_tokens", where, _int)
        elif text is None:
            raise TraceError(f"{where}: missing field 'prompt_tokens' (or 'prompt' text)")
        elif count_tokens is None:
            raise TraceError(f"{where}: field 'prompt' has no 'prompt_tokens': a tokenizer is needed to count it")
        else:
            n = count_tokens(text)
        t = _field(r, "timestamp", where, float) if has_time else 0.0
        block = _field(r, "hash_block", where, _int) if r.get("hash_block") is not None else HASH_BLOCK_TOKENS
        if block < 1:
            raise TraceError(f"{where}: field 'hash_block' must be >= 1")
        rows.append((t, n, _field(r, "output_tokens", where, _int), text, _hash_ids(r, where), block))
    if not timed:
        return RawTrace(tuple(TraceRequest(0.0, max(1, n), max(1, o), x, h, b) for _, n, o, x, h, b in rows),
                        "aserve", False)
    return _timed(rows, "aserve")


def _timed(rows: list[tuple], fmt: str) -> RawTrace:
    """Sort by time (stable) and make arrivals relative to the first request."""
    if not rows:
        return RawTrace((), fmt, True)
    rows = sorted(rows, key=lambda r: r[0])
    t0 = rows[0][0]
    reqs = tuple(TraceRequest(r[0] - t0, max(1, r[1]), max(1, r[2]), *r[3:]) for r in rows)
    return RawTrace(reqs, fmt, timed=True)


# ---- detection -----------------------------------------------------------------------------------
def detect_format(path: Path) -> str:
    """azure | lengths | mooncake | aserve, from the extension and the header or first record."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if "TIMESTAMP" in header:
            return "azure"
        if "num_prefill_tokens" in header:
            return "lengths"
        raise TraceError(f"{path}: unknown CSV header {header!r}: expected TIMESTAMP,ContextTokens,GeneratedTokens "
                         f"(Azure) or num_prefill_tokens,num_decode_tokens (lengths)")
    if suffix in (".jsonl", ".json"):
        first = next(_jsonl_rows(path), (None, {}))[1]
        if "input_length" in first:
            return "mooncake"
        if "output_tokens" in first:
            return "aserve"
        raise TraceError(f"{path}: unknown JSONL record keys {sorted(first)!r}: expected input_length/output_length "
                         f"(Mooncake) or prompt_tokens/prompt and output_tokens (aserve)")
    raise TraceError(f"{path}: unknown trace extension {suffix!r}: expected .csv or .jsonl")


def read_trace(path, count_tokens: Optional[Callable[[str], int]] = None) -> RawTrace:
    """Read any supported trace file (format auto-detected)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    fmt = detect_format(path)
    if fmt == "aserve":
        return read_aserve(path, count_tokens)
    return {"azure": read_azure, "lengths": read_lengths, "mooncake": read_mooncake}[fmt](path)
