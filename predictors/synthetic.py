"""Synthetic-but-plausible length labels for tests and demos (never for real measurements).

Real labels need the served model to generate for every prompt (``aserve label``). Tests must
not, yet a predictor can only be shown to learn when there is something to learn: these
lengths follow the kind of rules a chat model's lengths do (math word problems get a medium
worked answer growing with the problem, "write an essay/story" gets a long one, "list the
steps" a medium one, code a long one, short questions a short one), plus deterministic noise from the id.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

from predictors.dataset import PromptRow, id_hash

LONG = re.compile(r"\b(essay|story|article|blog|poem|detailed|explain|describe|script)\b", re.I)
MEDIUM = re.compile(r"\b(list|steps|compare|summar\w*|outline)\b", re.I)
CODE = re.compile(r"\b(code|function|python|javascript|sql|program|script|class|implement)\b", re.I)


def approx_tokens(text: str) -> int:
    """A tokenizer-free token count (about 1.3 tokens a word plus the chat template)."""
    return int(len(text.split()) * 1.3) + 10


def synthetic_length(p: PromptRow, max_length: int = 1024) -> int:
    noise = (id_hash(p.id, "synthetic") % 1000) / 1000 - 0.5  # uniform in [-0.5, 0.5)
    n = approx_tokens(p.prompt)
    if p.source == "gsm8k":
        base = 120 + 0.8 * n
    elif CODE.search(p.prompt):
        base = 480
    elif LONG.search(p.prompt):
        base = 620
    elif MEDIUM.search(p.prompt):
        base = 330
    elif n < 40:
        base = 70
    else:
        base = 200
    return int(min(max_length, max(1, base * (1 + 0.3 * noise))))


def write_synthetic_labels(prompts: Sequence[PromptRow], out: Path | str, max_length: int = 1024) -> Path:
    """A labels JSONL with one synthetic sample per prompt."""
    out = Path(out)
    with out.open("w") as f:
        for p in prompts:
            f.write(json.dumps({"id": p.id, "prompt_tokens": approx_tokens(p.prompt),
                                "output_tokens": [synthetic_length(p, max_length)], "max_tokens": max_length}) + "\n")
    return out
