"""``aserve predictor ceiling``: each backend's accuracy on a fresh sample, as a share of the
prompt-only ceiling of sampled labels (issue 25, target 2; the rules are in ``samples.py``).

    {"labels", "cap", "targets", "samples_per_prompt": {"min", "mean", "max"},
     "granularities": {"200": {"ceiling", "n", "single",          <- every prompt with >= 2 samples
                               "test": {"ceiling", "n"},          <- the held-out prompts the backends are scored on
                               "majority": {"fresh_sample_accuracy", "of_ceiling"},
                               "backends": {"sklearn": {"fresh_sample_accuracy", "of_ceiling", "trained"}}}}}

Backends are fitted on the train split (``targets`` says how the samples become rows) and scored
on the test split's prompts that have two samples or more, the same prompts as ``test.ceiling``.
``majority`` answers the train split's most common sample bucket every time.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from predictors.base import DEFAULT_MAX_LENGTH, Buckets
from predictors.dataset import is_test, read_labels, require_file
from predictors.samples import check_targets, fresh_sample_accuracy, heldout_ceiling


def ceiling_report(labels: Path | str, granularities: Sequence[int], backends: Sequence[str] = (),
                   prompts: Optional[Path | str] = None, targets: str = "samples", options: Optional[dict] = None,
                   retrain: bool = False) -> dict:
    """The report above; ``prompts`` is needed only when ``backends`` are scored."""
    check_targets(targets)
    require_file("labels", labels)
    rows = read_labels(labels)
    if not rows:
        raise ValueError(f"field 'labels': {labels} holds no labels")
    caps = [lab.max_tokens for lab in rows if lab.max_tokens]
    cap = max(caps) if caps else DEFAULT_MAX_LENGTH
    counts = [len(lab.lengths) for lab in rows]
    report = {"labels": str(labels), "cap": cap, "targets": targets,
              "samples_per_prompt": {"min": min(counts), "mean": round(sum(counts) / len(counts), 2),
                                     "max": max(counts)}, "granularities": {}}
    test = [lab.lengths for lab in rows if is_test(lab.id) and len(lab.lengths) >= 2]
    train_samples = [n for lab in rows if not is_test(lab.id) for n in lab.lengths]
    data = _dataset(prompts, labels) if backends else None
    for g in granularities:
        buckets = Buckets(g, cap)
        row = {**heldout_ceiling([lab.lengths for lab in rows], buckets), "test": heldout_ceiling(test, buckets)}
        row["test"].pop("single")
        if test and train_samples:
            majority = Counter(buckets.bucket_array(train_samples).tolist()).most_common(1)[0][0]
            row["majority"] = _share(fresh_sample_accuracy([majority] * len(test), test, buckets), row["test"])
        row["backends"] = {b: _score_backend(b, g, data, targets, options, retrain, row["test"]) for b in backends}
        report["granularities"][str(g)] = row
    return report


def _dataset(prompts, labels):
    from predictors.dataset import DEFAULT_PROMPTS
    from predictors.train import load_dataset

    return load_dataset(prompts or DEFAULT_PROMPTS, labels)


def _share(accuracy: float, test: dict) -> dict:
    ceiling = test["ceiling"]
    return {"fresh_sample_accuracy": accuracy, "of_ceiling": round(accuracy / ceiling, 4) if ceiling else None}


def _score_backend(backend: str, g: int, data, targets: str, options, retrain: bool, test: dict) -> dict:
    from predictors.evaluate import obtain_predictor, to_requests

    examples = [e for e in data.test if len(e.lengths) >= 2]
    if not examples:
        raise ValueError("field 'labels': no test-split prompt has two samples or more: "
                         "label with --samples K --temperature T")
    predictor, how = obtain_predictor(backend, g, data, None, retrain, options, targets)
    requests, predicted = to_requests(examples, data.max_length), []
    for i in range(0, len(requests), 64):
        predicted.extend(r.bucket for r in predictor.predict(requests[i:i + 64]))
    predictor.close()
    accuracy = fresh_sample_accuracy(predicted, [e.lengths for e in examples], predictor.buckets)
    return {**_share(accuracy, test), "trained": how}
