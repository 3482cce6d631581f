"""What a length predictor buys the scheduler: its share of the oracle's gain (issue 25, target 1).

    share(b) = (JCT_none - JCT_b) / (JCT_none - JCT_oracle)

``none`` is greedy decode admission with ``--predictor none`` (length-blind); the oracle and each
backend run a reservation policy (``reserve-dynamic`` or ``reserve-static``) that reads the
predicted range, with ``--dispatch interference``. 1 is as good as knowing every length, 0 no
better than not predicting, below 0 worse. The paper's Fig. 18 frames the same question with a
74.9%-accurate predictor against a 100% one.

A study is a grid of replays, one process each (``aserve replay TRACE --json FILE``), so it can
be stopped and resumed (a replay whose JSON exists is not run again)::

    for seed:   trace-s<seed>.jsonl                  aserve predictor trace --seed <seed>
                s<seed>/none.json                    greedy, --predictor none
                s<seed>/<policy>-oracle.json         <policy>, --predictor oracle
                s<seed>/<policy>-<backend>.json      <policy>, --predictor <backend>

then per policy and backend: the share per seed, its mean and spread (standard deviation,
min, max). A seed changes the trace (which held-out prompts, their arrival times, which sample
of each) and the engine's seed.
"""
from __future__ import annotations

import json
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

POLICIES = ("reserve-dynamic", "reserve-static")


def share(none: float, backend: float, oracle: float) -> Optional[float]:
    """The backend's share of the oracle's gain over ``none`` (means of one latency); None when
    the oracle gained nothing (there is no gain to share: the setting is wrong, not the backend)."""
    gain = none - oracle
    if gain <= 0:
        return None
    return (none - backend) / gain


def spread(values: Sequence[Optional[float]]) -> dict:
    """Mean, standard deviation, min and max over the seeds that have a share (``n`` of them)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    return {"n": len(xs), "mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs)}


@dataclass(frozen=True)
class ShareStudy:
    """The grid of replays: which backends, policies and seeds, on which trace, with which flags."""

    out: Path
    backends: tuple[str, ...] = ("sklearn", "lm", "retrieval")
    policies: tuple[str, ...] = POLICIES
    seeds: tuple[int, ...] = (0, 1, 2)
    trace_args: str = ""  # extra 'aserve predictor trace' flags (--num-requests, --rate, --labels, ...)
    system_args: str = ""  # flags every system shares (--mode, --kv-cache-gb, --dispatch, ...)
    replay_args: str = ""  # 'aserve replay' flags that are not a system's (--chat, --max-prompt-tokens, ...)
    metric: str = "jct"  # a latency of the replay report: jct | normalized_latency | ttft ...

    def __post_init__(self):
        if not self.backends or not self.policies or not self.seeds:
            raise ValueError("a share study needs at least one backend, policy and seed (fields 'backends', "
                             "'policies', 'seeds')")
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ValueError(f"field 'policies': {bad} are not reservation policies; use {', '.join(POLICIES)}")
        if any(b in ("none", "oracle") for b in self.backends):
            raise ValueError("field 'backends': none and oracle are the study's ends, always run")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"field 'seeds': repeated seeds {list(self.seeds)}")

    def systems(self) -> list[tuple[str, str]]:
        """``(name, system flags)`` of every replay of one seed."""
        out = [("none", "--decode-policy greedy --predictor none")]
        for policy in self.policies:
            out += [(f"{policy}-{b}", f"--decode-policy {policy} --predictor {b}") for b in ("oracle",) + self.backends]
        return out

    def trace(self, seed: int) -> Path:
        return self.out / f"trace-s{seed}.jsonl"

    def result(self, seed: int, name: str) -> Path:
        return self.out / f"s{seed}" / f"{name}.json"

    def commands(self, aserve: Sequence[str]) -> list[tuple[Path, list[str]]]:
        """``(file it writes, argv)`` for every step, in order: each seed's trace, then its replays."""
        steps = []
        for seed in self.seeds:
            trace = self.trace(seed)
            steps.append((trace, [*aserve, "predictor", "trace", "--out", str(trace), "--seed", str(seed),
                                  *shlex.split(self.trace_args)]))
            for name, flags in self.systems():
                argv = [*aserve, "replay", str(trace), "--name", name, "--seed", str(seed), "--no-progress",
                        "--json", str(self.result(seed, name)), *shlex.split(self.replay_args),
                        *shlex.split(self.system_args), *shlex.split(flags)]
                steps.append((self.result(seed, name), argv))
        return steps

    def summarize(self) -> dict:
        """Per policy and backend: the share on every seed whose three replays are done, and its spread;
        ``means``: every system's mean of the metric per seed (the figures the shares come from)."""
        table = {name: {str(seed): self._mean(seed, name) for seed in self.seeds} for name, _ in self.systems()}
        out = {"metric": self.metric, "policies": {}, "means": table}
        for policy in self.policies:
            rows = {}
            for b in self.backends:
                per_seed = {}
                for seed in map(str, self.seeds):
                    means = [table[n][seed] for n in ("none", f"{policy}-{b}", f"{policy}-oracle")]
                    if None not in means:
                        per_seed[seed] = share(*means)
                rows[b] = {"per_seed": per_seed, **spread(list(per_seed.values()))}
            out["policies"][policy] = rows
        return out

    def _mean(self, seed: int, name: str) -> Optional[float]:
        path = self.result(seed, name)
        if not path.is_file():
            return None
        systems = json.loads(path.read_text())["systems"]
        latency = systems[name][self.metric] if name in systems else next(iter(systems.values()))[self.metric]
        return None if not latency else float(latency["mean"])
