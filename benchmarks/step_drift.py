#!/usr/bin/env python3
"""Where a replay's steps ran off a cost model, instance by instance over time, and which requests paid.

A simulated device prices every step of a run with one profile scaled by one speed
(`aserve profile device --from-steps ... --speed-only`). When a validation cell misses, this shows
whether the run itself was uneven: measured over predicted time per instance in windows of the
run, and, given the trace, every request's TTFT rebuilt from the log (its prompt's chunks followed
from the first to the one that samples, matched to the trace by length, first come first served),
with the measured / predicted ratio of its instance's steps while it waited.

    benchmarks/step_drift.py steps.jsonl --system sarathi --profile speed.json [--window 10]
    benchmarks/step_drift.py steps.jsonl --system sarathi --profile speed.json --trace traces/LPLD.jsonl \\
        --max-prompt-tokens 1024 [--slowest 8]

The rebuilt TTFTs' mean and P99 should equal the replay report's (print both and compare): a
request whose chunks the log cannot follow (a preempted prompt recomputed elsewhere) is counted
as unmatched, not guessed.
"""
from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aserve.profiles import calibrate
from aserve.profiles.cost_model import CostModel
from aserve.engine.step_log import logged_step
from aserve.replay.traces import FitOptions, TraceError, load_trace


@dataclass(frozen=True)
class Step:
    instance: str
    t: float  # when it started, seconds into the run
    end: float  # when the instance was free again (t + busy_s)
    chunks: tuple
    decodes: int
    sampled: int
    measured: float
    predicted: float


def load(path: str, system: str, model: CostModel) -> list[Step]:
    """The system's steps in ``path`` with the model's price for each."""
    out = []
    for k, text in enumerate(Path(path).read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            d = json.loads(text)
            if d.get("system", "") != system:
                continue
            s = logged_step(d)
            out.append(Step(d["instance"], float(d["t"]), float(d["t"]) + float(d["busy_s"]), s.chunks,
                            len(s.decodes), s.sampled, s.seconds, calibrate.predict(model, s)))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{k}: not a step-log line ({type(e).__name__}: {e})") from None
    return out


def windows(steps: list[Step], width: float) -> dict[str, list[tuple[float, int, float, float]]]:
    """Instance -> (window start, steps, Σ measured, Σ predicted) for each window a step started in."""
    acc: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0.0]))
    for s in steps:
        w = acc[s.instance][int(s.t // width)]
        w[0] += 1
        w[1] += s.measured
        w[2] += s.predicted
    return {i: [(k * width, *v) for k, v in sorted(ws.items())] for i, ws in sorted(acc.items())}


@dataclass(frozen=True)
class FirstToken:
    request: int
    arrival: float
    prompt: int
    instance: str
    ttft: float
    drift: float  # Σ measured / Σ predicted of the instance's steps from arrival to first token


def first_tokens(steps: list[Step], arrivals: list[tuple[float, int]]) -> tuple[list[FirstToken], int]:
    """Each request's TTFT from the log (``arrivals``: the trace's (arrival s, prompt tokens) as
    replayed) and how many prompts could not be matched. A step samples one row per decode and
    one per prompt it finishes; only its last chunk can be a prompt the budget cut short."""
    open_chunks: dict[tuple[str, int], float] = {}
    finished, unmatched = [], 0
    for s in sorted(steps, key=lambda s: s.t):
        ends = s.sampled - s.decodes
        for k, (n, start) in enumerate(s.chunks):
            began = s.t if start == 0 else open_chunks.pop((s.instance, start), None)
            if began is None:  # the prompt's earlier chunks ran elsewhere: not followed
                unmatched += 1
                continue
            if k < ends:
                finished.append((began, start + n, s.end, s.instance))
            else:
                open_chunks[(s.instance, start + n)] = began
    # an instance's steps in time order with running sums, so a wait's steps are one slice of them
    mine: dict[str, tuple[list, list, np.ndarray, np.ndarray]] = {}
    for instance in {s.instance for s in steps}:
        own = sorted((s for s in steps if s.instance == instance), key=lambda s: s.t)
        mine[instance] = ([s.t for s in own], [s.end for s in own], np.cumsum([0.0] + [s.measured for s in own]),
                          np.cumsum([0.0] + [s.predicted for s in own]))
    waiting: dict[int, deque] = defaultdict(deque)  # prompt length -> requests in arrival order
    for i in sorted(range(len(arrivals)), key=lambda i: (arrivals[i][0], i)):
        waiting[arrivals[i][1]].append(i)
    out = []
    for began, length, first, instance in sorted(finished):
        queue = waiting.get(length)
        if not queue or arrivals[queue[0]][0] > began + 1e-3:
            unmatched += 1
            continue
        match = queue.popleft()
        arrival = arrivals[match][0]
        starts, ends, measured, predicted = mine[instance]
        lo, hi = bisect.bisect_right(ends, arrival), bisect.bisect_left(starts, first)
        drift = (measured[hi] - measured[lo]) / max(1e-12, predicted[hi] - predicted[lo])
        out.append(FirstToken(match, arrival, length, instance, first - arrival, drift))
    return out, unmatched + len(open_chunks)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="a step log written by `aserve replay --step-log`")
    p.add_argument("--system", required=True, help="the system's name in the log")
    p.add_argument("--profile", required=True, help="the cost model the simulated replay used (a profile JSON)")
    p.add_argument("--window", type=float, default=10.0, help="window width in seconds (default 10)")
    p.add_argument("--trace", default=None, help="the replayed trace: rebuild each request's TTFT")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="as the replay clipped prompts")
    p.add_argument("--num-requests", type=int, default=None, help="as the replay kept the first N")
    p.add_argument("--slowest", type=int, default=8, help="requests listed, slowest first (default 8)")
    a = p.parse_args(argv)
    if a.window <= 0:
        p.error("--window must be above 0")
    try:
        model = CostModel.load(a.profile)
        steps = load(a.log, a.system, model)
        trace = load_trace(a.trace, FitOptions(num_requests=a.num_requests, max_prompt_tokens=a.max_prompt_tokens)) \
            if a.trace else None
    except (OSError, ValueError, KeyError, TraceError) as e:
        print(f"step_drift: {e}", file=sys.stderr)
        return 2
    if not steps:
        print(f"step_drift: no steps of system {a.system!r} in {a.log}", file=sys.stderr)
        return 2
    total = sum(s.measured for s in steps) / sum(s.predicted for s in steps)
    print(f"{a.system}: {len(steps)} steps, measured / predicted {total:.3f} over the run")
    by = windows(steps, a.window)
    names = list(by)
    print("| from s | " + " | ".join(f"{i}: steps, measured / predicted" for i in names) + " |")
    print("|---:|" + "---:|" * len(names))
    starts = sorted({w[0] for ws in by.values() for w in ws})
    cells = {i: {w[0]: w for w in ws} for i, ws in by.items()}
    for t in starts:
        row = [f"{cells[i][t][1]}, {cells[i][t][2] / cells[i][t][3]:.3f}" if t in cells[i] else "-" for i in names]
        print(f"| {t:.0f} | " + " | ".join(row) + " |")
    if trace is None:
        return 0
    got, unmatched = first_tokens(steps, [(r.arrival_s, r.prompt_tokens) for r in trace.requests])
    if not got:
        print("step_drift: no prompt in the log matched the trace", file=sys.stderr)
        return 2
    v = np.array([f.ttft for f in got])
    print(f"\nTTFT rebuilt for {len(got)} of {len(trace.requests)} requests ({unmatched} prompts not followed): "
          f"mean {v.mean():.3f} s, P99 {np.percentile(v, 99):.3f} s, max {v.max():.3f} s")
    print("| request | arrival s | prompt | instance | TTFT s | its instance's steps meanwhile: measured / predicted |")
    print("|---:|---:|---:|---|---:|---:|")
    for f in sorted(got, key=lambda f: -f.ttft)[:a.slowest]:
        print(f"| {f.request} | {f.arrival:.1f} | {f.prompt} | {f.instance} | {f.ttft:.2f} | {f.drift:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
