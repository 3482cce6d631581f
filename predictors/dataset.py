"""Prompts, length labels, and the train/test split by prompt id.

Two files meet here:

    prompts.jsonl   {"id", "source", "prompt", ...}            (the shared prompt pool)
    labels.jsonl    {"id", "prompt_tokens", "output_tokens": [n, ...], "max_tokens"}

A label line holds one output length per sample (``samples > 1`` at temperature > 0 records
the spread of the served model's lengths). Joining the two by id gives ``Example`` rows, the
predictors' training and evaluation unit.

The split is a pure function of the prompt id (a salted SHA-1), never of row order: the same
prompt lands on the same side in every run, every label file and every machine, and a
labelling run cut short (a prefix of the pool) still splits about 80/20.
"""
from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "prompts.jsonl"
DEFAULT_LABELS = Path(__file__).resolve().parent / "data" / "labels_smollm2.jsonl"
TEST_FRACTION = 0.2
SPLITS = ("all", "train", "test")


@dataclass(frozen=True)
class PromptRow:
    """One prompt of the pool."""

    id: str
    source: str
    prompt: str

    def __post_init__(self):
        if not self.id:
            raise ValueError("prompt row has an empty 'id'")
        if not self.prompt:
            raise ValueError(f"prompt {self.id!r} has an empty 'prompt'")


@dataclass(frozen=True)
class Label:
    """The served model's output lengths for one prompt (one per sample)."""

    id: str
    prompt_tokens: int
    output_tokens: tuple[int, ...]
    max_tokens: Optional[int] = None  # the cap the labeller used; a length equal to it is censored

    def __post_init__(self):
        if not self.id:
            raise ValueError("label has an empty 'id'")
        if not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 1:
            raise ValueError(f"label {self.id!r}: 'prompt_tokens' must be an integer >= 1, got {self.prompt_tokens!r}")
        if not self.output_tokens or any(not isinstance(n, int) or n < 0 for n in self.output_tokens):
            raise ValueError(f"label {self.id!r}: 'output_tokens' must be a non-empty list of integers >= 0")

    @property
    def length(self) -> int:
        """The default training target: the median over samples (robust to one runaway sample)."""
        return int(round(statistics.median(self.output_tokens)))

    @property
    def lengths(self) -> tuple[int, ...]:
        """Every sample's length (one for greedy labels): what a fresh request of this prompt may do."""
        return self.output_tokens


@dataclass(frozen=True)
class Example:
    """A prompt with its true output length: what ``fit`` learns from and ``evaluate`` scores."""

    id: str
    prompt: str
    prompt_tokens: int
    length: int  # the target (the samples' median unless training says otherwise: predictors/samples.py)
    source: str = ""
    lengths: tuple[int, ...] = ()  # every sample's length; () means the one sample ``length``

    def __post_init__(self):
        if not self.prompt:
            raise ValueError(f"example {self.id!r} has an empty prompt")
        if self.length < 0 or self.prompt_tokens < 1:
            raise ValueError(f"example {self.id!r}: length must be >= 0 and prompt_tokens >= 1")
        if not self.lengths:
            object.__setattr__(self, "lengths", (self.length,))
        elif any(n < 0 for n in self.lengths):
            raise ValueError(f"example {self.id!r}: every sample length must be >= 0 (field 'lengths')")


def require_file(field: str, path: Path | str) -> None:
    """FileNotFoundError naming the command-line field when ``path`` is not a file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"field {field!r}: no such file {str(path)!r}")


def iter_jsonl(path, error: type = ValueError) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL file; a line that is not a JSON
    object raises ``error`` naming the file and line. Shared by prompts, labels and
    the server's trace reader."""
    with open(path) as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{i}: a line must be a JSON object")
            yield i, obj


def _jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {str(path)!r}")
    yield from iter_jsonl(path)


def _field(path: Path, lineno: int, row: dict, name: str):
    if name not in row:
        raise ValueError(f"{path}:{lineno}: missing field {name!r}")
    return row[name]


def load_prompts(path: Path | str = DEFAULT_PROMPTS) -> list[PromptRow]:
    """Every prompt of a prompts JSONL file, in file order; duplicate ids are an error."""
    rows, seen = [], set()
    for lineno, row in _jsonl(Path(path)):
        pid = str(_field(path, lineno, row, "id"))
        if pid in seen:
            raise ValueError(f"{path}:{lineno}: duplicate 'id' {pid!r}")
        seen.add(pid)
        try:
            rows.append(PromptRow(pid, str(row.get("source", "")), str(_field(path, lineno, row, "prompt"))))
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
    return rows


def read_labels(path: Path | str) -> list[Label]:
    """Every label of a labels JSONL file; a later line for the same id replaces an earlier one."""
    by_id: dict[str, Label] = {}
    for lineno, row in _jsonl(Path(path)):
        outs = _field(path, lineno, row, "output_tokens")
        if not isinstance(outs, list):
            raise ValueError(f"{path}:{lineno}: field 'output_tokens' must be a list, got {type(outs).__name__}")
        try:
            label = Label(str(_field(path, lineno, row, "id")), _field(path, lineno, row, "prompt_tokens"),
                          tuple(outs), row.get("max_tokens"))
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
        by_id[label.id] = label
    return list(by_id.values())


def check_labels_match(labels: Sequence[Label], prompts: Sequence[PromptRow]) -> None:
    """Raise ValueError when a label's id is not among the prompts (the wrong prompts file)."""
    known = {p.id for p in prompts}
    unknown = [lab.id for lab in labels if lab.id not in known]
    if unknown:
        shown = ", ".join(repr(i) for i in unknown[:5])
        raise ValueError(f"{len(unknown)} of {len(labels)} label ids are not in the prompts file "
                         f"(field 'id'; first: {shown}): labels and prompts do not match")


def join_examples(prompts: Sequence[PromptRow], labels: Sequence[Label]) -> list[Example]:
    """One ``Example`` per label, in label order, after checking every id is known."""
    check_labels_match(labels, prompts)
    by_id = {p.id: p for p in prompts}
    return [Example(lab.id, by_id[lab.id].prompt, lab.prompt_tokens, lab.length, by_id[lab.id].source, lab.lengths)
            for lab in labels]


def load_examples(prompts_path: Path | str = DEFAULT_PROMPTS,
                  labels_path: Path | str = DEFAULT_LABELS) -> list[Example]:
    return join_examples(load_prompts(prompts_path), read_labels(labels_path))


def id_hash(prompt_id: str, salt: str) -> int:
    """A stable 64-bit hash of an id (Python's ``hash`` is salted per process: useless here)."""
    return int.from_bytes(hashlib.sha1(f"{salt}:{prompt_id}".encode()).digest()[:8], "big")


def is_test(prompt_id: str, test_fraction: float = TEST_FRACTION) -> bool:
    """True when this prompt id belongs to the test split."""
    if not 0 <= test_fraction <= 1:
        raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
    return id_hash(prompt_id, "split") % 10_000 < round(test_fraction * 10_000)


def split_by_id(items: Iterable, test_fraction: float = TEST_FRACTION) -> tuple[list, list]:
    """``(train, test)`` of anything with an ``id`` attribute, by the hash of the id."""
    train, test = [], []
    for item in items:
        (test if is_test(item.id, test_fraction) else train).append(item)
    return train, test


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"field 'split': expected one of {', '.join(SPLITS)}, got {split!r}")


def in_split(prompt_id: str, split: str) -> bool:
    """True when the id belongs to ``split``: ``all``, ``train`` or ``test``."""
    check_split(split)
    return split == "all" or is_test(prompt_id) == (split == "test")


def labelling_order(prompts: Sequence[PromptRow]) -> list[PromptRow]:
    """Prompts in a stable pseudo-random order, so that any prefix mixes every source."""
    return sorted(prompts, key=lambda p: id_hash(p.id, "order"))
