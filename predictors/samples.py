"""What sampled labels say: a prompt's length is a distribution, not a number.

API users sample (temperature 0.7-1.0, top-p), so the same prompt answers at different lengths.
``aserve label --samples K --temperature T`` records K lengths a prompt (``Label.lengths``);
this module turns them into what the predictors are trained and judged on (issue 25, target 2):

- **training targets** (``TARGETS``): ``median`` (one row a prompt, the samples' median, the
  old behaviour), ``samples`` (one row per sample: the classifier learns each prompt's bucket
  frequencies, so its argmax is the bucket a fresh sample most likely falls in), ``mode`` (one
  row a prompt, in its modal bucket at the training granularity);
- **a replay's length** (``pick_length``): one sample per request, chosen by a seeded draw, not
  the median (a served request is one sample);
- **the ceiling** (``heldout_ceiling``): no rule that sees only the prompt can beat knowing its
  length distribution, and the best prompt-only rule given K-1 samples is their modal bucket.
  For each prompt with K >= 2 samples, each sample in turn is held out and predicted by the
  modal bucket of the other K-1 (a tie between modes counts as a fair draw among them:
  1 / number of modes when the held-out bucket is one of them); the hits are averaged over the
  held-out choices, then over prompts (a fresh request is a random prompt and a random sample).
  With few samples this estimates the mode a little worse than the true distribution's mode
  would do, so it is a slightly low ceiling, never a high one;
- **a backend on a fresh sample** (``fresh_sample_accuracy``): its predicted bucket against
  every sample of the prompt, averaged the same way, which is what its accuracy on the next
  sampled request would be; ``of_ceiling`` = that / the ceiling on the same prompts.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from typing import Sequence

import numpy as np

from predictors.base import Buckets
from predictors.dataset import Example

TARGETS = ("median", "samples", "mode")


def check_targets(targets: str) -> None:
    if targets not in TARGETS:
        raise ValueError(f"field 'targets': expected one of {', '.join(TARGETS)}, got {targets!r}")


def modal_buckets(buckets_of_samples: Sequence[int]) -> list[int]:
    """Every bucket that holds the most samples (one unless there is a tie), ascending."""
    counts = Counter(buckets_of_samples)
    top = max(counts.values())
    return sorted(b for b, n in counts.items() if n == top)


def training_rows(examples: Sequence[Example], targets: str, buckets: Buckets) -> list[Example]:
    """The rows a backend is fitted on, from labelled examples (see the module docstring)."""
    check_targets(targets)
    if targets == "median":
        return list(examples)
    if targets == "samples":
        return [replace(e, length=n) for e in examples for n in e.lengths]
    rows = []
    for e in examples:  # mode: the median of the samples in the modal bucket (the lower one on a tie)
        mode = modal_buckets(buckets.bucket_array(e.lengths).tolist())[0]
        inside = [n for n in e.lengths if buckets.bucket_of(n) == mode]
        rows.append(replace(e, length=int(np.median(inside))))
    return rows


def pick_length(example: Example, how: str, seed: int) -> int:
    """A replay's output length for this prompt: ``median``, or ``sample`` (one sample, drawn
    by ``seed`` and the prompt id only, so a trace is the same on every machine)."""
    if how == "median":
        return example.length
    if how != "sample":
        raise ValueError(f"field 'length': expected median or sample, got {how!r}")
    return random.Random(f"{seed}/{example.id}").choice(example.lengths)


def heldout_ceiling(lengths_per_prompt: Sequence[Sequence[int]], buckets: Buckets) -> dict:
    """The prompt-only ceiling over prompts with >= 2 samples: ``{"ceiling", "n", "single"}``
    (``single``: prompts skipped for having one sample). ``ceiling`` is None when none has two."""
    per_prompt, single = [], 0
    for lengths in lengths_per_prompt:
        if len(lengths) < 2:
            single += 1
            continue
        b = buckets.bucket_array(lengths).tolist()
        hits = 0.0
        for j in range(len(b)):
            modes = modal_buckets(b[:j] + b[j + 1:])
            hits += (b[j] in modes) / len(modes)
        per_prompt.append(hits / len(b))
    return {"ceiling": round(float(np.mean(per_prompt)), 4) if per_prompt else None, "n": len(per_prompt),
            "single": single}


def fresh_sample_accuracy(predicted: Sequence[int], lengths_per_prompt: Sequence[Sequence[int]],
                          buckets: Buckets) -> float:
    """How often a predicted bucket holds a fresh sample: per prompt the share of its samples in
    the predicted bucket, averaged over prompts."""
    if len(predicted) != len(lengths_per_prompt) or not predicted:
        raise ValueError(f"need one prediction per prompt, got {len(predicted)} for {len(lengths_per_prompt)}")
    shares = [float((buckets.bucket_array(lengths) == p).mean()) for p, lengths in zip(predicted, lengths_per_prompt)]
    return round(float(np.mean(shares)), 4)
