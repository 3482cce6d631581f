#!/usr/bin/env python3
"""How fast the machine ran each system of one or more real replays, from their step logs.

A shared 2-core VM does not run at one speed: the same system replayed twice in one session
differed by 18% in mean JCT, and at saturation every request's latency multiplies the step time
(docs/notes/simulator.md, "The AVX2 machine"). This fits one linear model to every decode-only step of
the given logs (a fixed cost, a row's, a token of context's, the neighbour's overlap) and prints,
per system, the median of measured / fitted: 1.00 is the logs' average speed, 1.10 a run whose
steps took 10% longer than the same shapes took on average. Put it beside any real comparison.

    benchmarks/step_speed.py steps_HPLD.jsonl [more.jsonl ...]    # a file's systems as FILE:SYSTEM if several files
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import numpy as np


def decode_steps(paths: list[str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Features, measured seconds and the system of every decode-only step in the logs."""
    rows, seconds, systems = [], [], []
    for path in paths:
        with open(path) as f:
            for line in f:
                step = json.loads(line)
                if step["chunks"] or not step["decodes"]:
                    continue
                rows.append([1.0, len(step["decodes"]), sum(step["decodes"]), step.get("overlap", 0.0)])
                seconds.append(step["forward_s"])
                systems.append(step["system"] if len(paths) == 1 else f"{path}:{step['system']}")
    return np.array(rows), np.array(seconds), systems


def speeds(paths: list[str]) -> dict[str, tuple[float, int]]:
    """System -> (median measured / fitted, number of decode-only steps)."""
    x, y, systems = decode_steps(paths)
    if len(y) < 4:  # one per coefficient at the least
        raise ValueError(f"too few decode-only steps in {', '.join(paths)} to fit a step model")
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    ratio = y / (x @ coef)
    by = defaultdict(list)
    for name, r in zip(systems, ratio):
        by[name].append(r)
    return {name: (float(np.median(r)), len(r)) for name, r in by.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="step logs written by `aserve replay --step-log`")
    a = p.parse_args(argv)
    try:
        found = speeds(a.logs)
    except (OSError, ValueError, KeyError) as e:
        print(f"step_speed: {e}", file=sys.stderr)
        return 2
    print("| system | decode-only steps | step speed (measured / fitted, median) |")
    print("|---|---:|---:|")
    for name, (speed, n) in found.items():
        print(f"| {name} | {n} | {speed:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
