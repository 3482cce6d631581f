"""How often two label runs of the same prompts agree: the labels' own noise floor.

A label is one greedy run of the served model, and greedy decoding is deterministic only for
a fixed arithmetic. On the CPU path our engine gave each prompt the same length whatever it
was batched with (docs/notes/predictors.md), but another build of the kernels, another dtype or
another device rounds differently, and an
answer that hovers between stopping and repeating itself can go either way. Labelling the same
prompts again under other arithmetic (``aserve label --split test --limit 768 ...`` today
against labels made by an older build, or with ``--dtype fp32``) and comparing the two files
says how much of a length is the prompt and how much is the arithmetic, which is the
yardstick for a predictor's accuracy on these labels::

    aserve predictor agree predictors/data/labels_smollm2.jsonl relabel.jsonl --json agree.json

    {"n", "only_in_a", "only_in_b", "cap", "identical_length", "mae_tokens",
     "at_cap": {"a", "b", "both"},
     "granularities": {"100": {"same_bucket", "within_one_bucket", "num_buckets"}, ...}}

Both files are cut at the lower of their two caps (``max_tokens``), so a run with a longer cap
is compared on the lengths both could record. ``same_bucket`` is what a predictor's
``accuracy`` would be if it answered with the other run's length. If the two runs are
independent draws of each prompt's chance of landing in each bucket, then for a two-bucket
split where they disagree on a fraction ``f`` of prompts, the best any predictor of one run can
score lies between ``1 - f`` (every disagreement a fair coin) and ``1 - f / 2``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from predictors.base import Buckets, bucket_match
from predictors.dataset import Label


def _cap(labels: Sequence[Label], which: str) -> int:
    caps = {lab.max_tokens for lab in labels if lab.max_tokens}
    if not caps:
        raise ValueError(f"field 'max_tokens': the labels of {which} record no cap, so a length at the cap "
                         "cannot be told from a finished answer")
    return min(caps)


def label_agreement(a: Sequence[Label], b: Sequence[Label], granularities: Sequence[int]) -> dict:
    """Agreement of two label runs on the prompt ids they share (see the module docstring)."""
    by_b = {lab.id: lab for lab in b}
    shared = [lab for lab in a if lab.id in by_b]
    if not shared:
        raise ValueError("field 'id': the two label files share no prompt id: nothing to compare")
    cap = min(_cap(a, "the first file"), _cap(b, "the second file"))
    la = np.minimum([lab.length for lab in shared], cap)
    lb = np.minimum([by_b[lab.id].length for lab in shared], cap)
    out = {"n": len(shared), "only_in_a": len(a) - len(shared), "only_in_b": len(b) - len(shared), "cap": int(cap),
           "identical_length": round(float((la == lb).mean()), 4),
           "mae_tokens": round(float(np.abs(la - lb).mean()), 1),
           "at_cap": {"a": round(float((la >= cap).mean()), 4), "b": round(float((lb >= cap).mean()), 4),
                      "both": round(float(((la >= cap) & (lb >= cap)).mean()), 4)},
           "granularities": {}}
    for g in granularities:
        buckets = Buckets(g, cap)
        same, near = bucket_match(buckets.bucket_array(la), buckets.bucket_array(lb))
        out["granularities"][str(g)] = {"same_bucket": same, "within_one_bucket": near,
                                        "num_buckets": buckets.num_buckets}
    return out
