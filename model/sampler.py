"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

An unseeded row is drawn by inverting its cumulative distribution at one uniform draw (a float64
running sum and a binary search): about 0.1 ms for the default model's 49,152-token vocabulary on
one core, where ``torch.multinomial`` took 1.2 ms a row, a sixth of a 4-row decode step. A seeded
row keeps multinomial's exponential race (``_race``), which the rounding of other rows' batches
almost never sways; the running sum in token order can (a last-bit change in every logit moves it by
about a tail token's probability).

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
    greedy_rows = [i for i, spec in enumerate(specs) if spec.temperature == 0]
    greedy = {}
    if greedy_rows:  # an argmax over the vocabulary is ~0.1 ms a row: only the rows that want it
        picked = logits if len(greedy_rows) == len(specs) else logits[greedy_rows]
        greedy = dict(zip(greedy_rows, picked.argmax(dim=-1).tolist()))
    return [greedy[i] if i in greedy else _sample_row(logits[i], spec, generator) for i, spec in enumerate(specs)]


def _sample_row(row: torch.Tensor, spec: SampleSpec, generator: torch.Generator | None) -> int:
    row = row.float() / spec.temperature
    if spec.top_k and spec.top_k < row.shape[-1]:
        kth = torch.topk(row, spec.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = row.softmax(-1)
    if spec.top_p < 1.0:
        top, order = _nucleus(probs, spec.top_p)
        if spec.seed is None:
            return int(order[_draw(top, generator)].item())
        probs = torch.zeros_like(probs).scatter_(0, order, top)  # the race runs over every token id
    if spec.seed is not None:
        return _race(probs, torch.Generator(device=row.device).manual_seed(_mix(spec.seed, spec.step)))
    return _draw(probs, generator)


def _race(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A seeded row's token: the first of an exponential race, ``argmax(p_i / E_i)`` with one
    ``E_i ~ Exp(1)`` a token, in token order from the seed (``torch.multinomial``'s own draw, so
    the same tokens it gave). Each token's chance rests on its own draw, so the last-bit
    differences another batch's products make in the logits almost never change the winner:
    what a seed promises. It costs 1.2 ms a row (a random number a token), ten times ``_draw``."""
    return int((probs / torch.empty_like(probs).exponential_(generator=generator)).argmax().item())


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus of ``probs``, most likely first: (its probabilities, their token ids). A token
    drops when the tokens before it already reach ``top_p``; the most likely always stays. Only
    the head of the distribution is sorted (64 tokens, four times more while those hold less than
    ``top_p``): every token past a head that reaches ``top_p`` drops, and sorting the whole
    vocabulary took 4 ms a row."""
    vocab = probs.shape[-1]
    k = min(64, vocab)
    while True:
        top, order = probs.topk(k)
        before = top.cumsum(-1) - top
        if k == vocab or before[-1] + top[-1] >= top_p:
            break
        k = min(vocab, 4 * k)
    keep = before < top_p
    keep[0] = True  # even when top_p rounds to 0
    return top[keep], order[keep]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` (non-negative, summing to about 1): the first token whose running
    sum passes a uniform draw in [0, total). The sum runs in float64 and the draw is scaled to its
    own total, so rounding neither skews the tail nor leaves a gap; a token of probability 0
    adds nothing to the sum and so is never the first to pass it."""
    cum = probs.double().cumsum(-1)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device) * cum[-1]
    index = int(torch.searchsorted(cum, u, right=True).item())
    if index >= probs.shape[-1]:  # u rounded up to the total: the last token that can be drawn
        index = int(torch.nonzero(probs > 0)[-1].item())
    return index


def _mix(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + 0x9E3779B9) % (2**63 - 1)
