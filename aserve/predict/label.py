"""Length labels: send prompts through our own engine and record how many tokens it generates.

As in TetriInfer (§3.3.2), a length predictor must learn the *served* model's lengths, not a
reference answer's: each prompt is wrapped in the model's chat template, generated greedily by
default, and its output token count written as one JSONL line

    {"id": ..., "prompt_tokens": 57, "output_tokens": [212], "max_tokens": 1024}

``output_tokens`` holds one entry per sample; ``samples > 1`` needs ``temperature > 0`` and
records the spread of lengths for the same prompt. Lines are appended and flushed after every
batch, and a rerun skips ids already in the file, so a long run can be stopped and resumed.
Prompts go in a stable hash-of-id order (``labelling_order``), so ``limit=N`` labels an
unbiased sample of the pool and a larger ``limit`` later extends it. ``split="test"`` (or
``"train"``) keeps only that side of the predictors' split by id first, e.g. to label the
held-out prompts a second time and see how reproducible the labels are
(``aserve predictor agree``).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from predictors.dataset import (Label, PromptRow, check_labels_match, check_split, id_hash, in_split, is_test,
                                labelling_order, load_prompts, read_labels, split_by_id)

# the label file's readers and the id split live with the predictors; re-exported for callers of this module
__all__ = ["label_prompts", "done_ids", "read_labels", "load_prompts", "split_by_id", "is_test",
           "check_labels_match", "Label"]


def done_ids(out_path: Path) -> set[str]:
    """Ids already labelled in ``out_path`` (empty when the file does not exist yet)."""
    return {lab.id for lab in read_labels(out_path)} if Path(out_path).is_file() else set()


def _check_args(temperature: float, samples: int, batch_size: int, max_tokens: int, limit: Optional[int]) -> None:
    if samples < 1 or batch_size < 1 or max_tokens < 1:
        raise ValueError("samples, batch_size and max_tokens must be >= 1")
    if samples > 1 and temperature == 0:
        raise ValueError("samples > 1 needs temperature > 0: greedy decoding gives the same length every time")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")


def _todo(prompts_path, out_path, limit: Optional[int], split: str = "all") -> tuple[list[PromptRow], int]:
    """The prompts still to label (the first ``limit`` of the stable order within ``split``,
    minus those done)."""
    pool = load_prompts(prompts_path)
    done = read_labels(out_path) if Path(out_path).is_file() else []
    check_labels_match(done, pool)  # appending to another pool's labels would mix two data sets
    done_set = {lab.id for lab in done}
    prompts = labelling_order([p for p in pool if in_split(p.id, split)])[:limit]
    return [p for p in prompts if p.id not in done_set], len(done_set)


def _label_batch(llm, batch: Sequence[PromptRow], sampling, samples: int, progress) -> list[dict]:
    """Generate ``samples`` outputs for every prompt of the batch; one JSON-able row per prompt."""
    from scheduling.request import SamplingParams

    prompts, params = [], []
    for p in batch:
        for s in range(samples):
            seed = None if sampling.greedy else id_hash(f"{p.id}#{s}", "sample") & 0x7FFFFFFF  # stable across runs
            prompts.append(p.prompt)
            params.append(SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                         top_p=sampling.top_p, seed=seed))
    outs = llm.generate(prompts, params, chat=True, progress=progress)
    rows = []
    for i, p in enumerate(batch):
        mine = outs[i * samples:(i + 1) * samples]
        rows.append({"id": p.id, "prompt_tokens": len(mine[0].prompt_token_ids),
                     "output_tokens": [len(o.token_ids) for o in mine], "max_tokens": sampling.max_tokens})
    return rows


def _split_fitting(llm, batch: Sequence[PromptRow], max_tokens: int) -> tuple[list[PromptRow], int]:
    """Drop prompts whose template plus ``max_tokens`` exceeds the context window (they are not labelled)."""
    limit = llm.bundle.args.max_position
    keep = [p for p in batch if len(llm.bundle.encode(p.prompt, chat=True)) + max_tokens <= limit]
    return keep, len(batch) - len(keep)


def label_prompts(prompts_path, out_path, engine_cfg, temperature: float = 0.0, top_p: float = 1.0,
                  samples: int = 1, batch_size: int = 256, limit: Optional[int] = None,
                  max_tokens: int = 1024, quiet: bool = False, llm=None, split: str = "all") -> dict:
    """Label prompts with the served model's output lengths, appending to ``out_path``; resumes.

    ``split``: ``all`` the pool, or only its ``train`` / ``test`` side (the predictors' split by id).

    ``llm``: an already loaded ``LLM`` to reuse (else one is built from ``engine_cfg``).
    Returns a summary: prompts labelled now, skipped as too long, already done, tokens, seconds.
    """
    from aserve.engine.offline import LLM
    from scheduling.request import SamplingParams

    _check_args(temperature, samples, batch_size, max_tokens, limit)
    check_split(split)  # a bad split name fails before any file is read
    todo, num_done = _todo(prompts_path, out_path, limit, split)
    summary = {"labelled": 0, "too_long": 0, "already_done": num_done, "tokens": 0, "seconds": 0.0}
    if todo:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        _run(llm or LLM(engine_cfg), todo, Path(out_path), sampling, samples, batch_size, quiet, summary)
    return summary


def _run(llm, todo: list[PromptRow], out_path: Path, sampling, samples: int, batch_size: int, quiet: bool,
         summary: dict) -> None:
    """The labelling loop: one engine call per batch, its lines appended and flushed at once. On a
    terminal a live bar; elsewhere (a log: a live bar shows nothing there) a line after each batch."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    out_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    columns = (TextColumn("labelling"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
               TimeRemainingColumn())
    lines = not quiet and not sys.stderr.isatty()
    with Progress(*columns, disable=quiet or lines) as bar, out_path.open("a") as f:
        task = bar.add_task("labelling", total=len(todo), rate="")

        def tick(_num_done: int, num_tokens: int) -> None:  # the engine calls this after every step
            summary["tokens"] += num_tokens
            rate = summary["tokens"] / max(time.perf_counter() - start, 1e-9)
            bar.update(task, rate=f"{rate:,.0f} tok/s (prefill + decode)")

        for i in range(0, len(todo), batch_size):
            batch, too_long = _split_fitting(llm, todo[i:i + batch_size], sampling.max_tokens)
            rows = _label_batch(llm, batch, sampling, samples, tick) if batch else []
            f.write("".join(json.dumps(row) + "\n" for row in rows))
            f.flush()  # a killed run loses at most the batch in flight
            summary["labelled"] += len(rows)
            summary["too_long"] += too_long
            bar.update(task, advance=len(batch) + too_long)
            if lines:
                _say_progress(min(i + batch_size, len(todo)), len(todo), summary["tokens"], time.perf_counter() - start)
    summary["seconds"] = round(time.perf_counter() - start, 2)


def _say_progress(done: int, total: int, tokens: int, elapsed: float) -> None:
    eta = elapsed / done * (total - done)
    print(f"labelling {done}/{total} prompts ({done / total:.0%}), {tokens / max(elapsed, 1e-9):,.0f} tok/s "
          f"(prefill + decode), {elapsed:.0f} s elapsed, ETA {eta:.0f} s", file=sys.stderr, flush=True)
