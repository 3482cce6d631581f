"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws step ``i`` from a generator seeded with ``(seed, i)``, so its tokens do
not depend on which other requests share the batch, on preemption, or on which instance runs
the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SampleSpec:
    """The sampling knobs of one row of logits."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    step: int = 0  # output tokens generated so far (seeds step i)


def sample(logits: torch.Tensor, specs: list[SampleSpec], generator: torch.Generator | None = None) -> list[int]:
    """logits: [N, vocab] float32 -> one token id per row."""
    assert logits.shape[0] == len(specs)
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, spec in enumerate(specs):
        if spec.temperature == 0:
            out.append(greedy[i])
        else:
            out.append(_sample_row(logits[i], spec, generator))
    return out


def _sample_row(row: torch.Tensor, spec: SampleSpec, generator: torch.Generator | None) -> int:
    row = row.float() / spec.temperature
    if spec.top_k and spec.top_k < row.shape[-1]:
        kth = torch.topk(row, spec.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_logits, order = row.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop = (cum - sorted_logits.softmax(-1)) >= spec.top_p
        drop[0] = False  # the most likely token always stays, even when top_p rounds to 0
        row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = row.softmax(-1)
    if spec.seed is not None:
        gen = torch.Generator(device=row.device).manual_seed(_mix(spec.seed, spec.step))
    else:
        gen = generator
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _mix(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + 0x9E3779B9) % (2**63 - 1)
