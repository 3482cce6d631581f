"""The step log: one JSON line per step an instance executed, timed where it ran (``aserve
replay --step-log FILE``), for fitting a simulated device's cost model on steps as a replay runs
them (aserve/profiles/calibrate.py) rather than on steps timed one at a time in isolation.

    {"system": "tetri", "instance": "p0", "role": "prefill", "t": 12.41,
     "chunks": [[48, 96]], "decodes": [], "pad": 0, "sampled": 0, "swapped": 0,
     "forward_s": 0.0731, "busy_s": 0.0744, "cpu_s": 0.0729, "neighbours": 1, "overlap": 0.93}

- ``chunks``: prompt chunks (or recomputes) as [tokens, start]; ``decodes``: decode rows' contexts;
  ``pad``: padding rows; ``sampled``: rows that produce logits; ``swapped``: KV blocks swapped.
- ``forward_s``: the device's own time for the step (the runner's clock on its thread: the
  forward, not the hand-off to the thread or the loop's wait to resume); ``busy_s``: how long the
  step held the instance, as its loop saw it; ``cpu_s``: the stepping thread's CPU seconds.
- ``neighbours``: other instances of the cluster with a step in flight when this one started
  (the simulated device's contention rule reads the same); ``overlap``: the seconds their steps
  overlapped this one, over its length (above 1 with several neighbours).

The log is written on the event-loop thread (the thread rule); an instance without one
(``step_log`` None, the default) pays nothing.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterable, Optional

from aserve.profiles.cost_model import plan_shape


class StepLog:
    """A step-log file and which instances are stepping now (their busy seconds so far)."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Optional[IO[str]] = self.path.open("w")
        self.num_lines = 0
        self.start_system("", time.monotonic)

    def start_system(self, name: str, clock_now: Callable[[], float]) -> None:
        """The steps that follow are system ``name``'s (a ``--compare`` run replays several in
        turn), timed on its cluster's clock (virtual on simulated devices)."""
        self.system, self.now, self.t0 = name, clock_now, clock_now()
        self._since: dict[str, float] = {}  # instance -> start of its step in flight
        self._busy: dict[str, float] = {}  # instance -> seconds of finished steps

    def _others_busy_s(self, instance_id: str, now: float) -> float:
        """Busy seconds of every other instance up to ``now`` (steps in flight included)."""
        total = sum(s for iid, s in self._busy.items() if iid != instance_id)
        return total + sum(now - t for iid, t in self._since.items() if iid != instance_id)

    def begin(self, instance_id: str) -> tuple[float, int, float]:
        """A step starts: (now, neighbours stepping, their busy seconds so far), for ``end``."""
        now = self.now()
        neighbours = sum(iid != instance_id for iid in self._since)
        others = self._others_busy_s(instance_id, now)
        self._since[instance_id] = now
        return now, neighbours, others

    def end(self, instance_id: str, role: str, plan, out, cpu_s: float, token: tuple[float, int, float]) -> None:
        """The step ended (or raised: ``out`` None, nothing written)."""
        start, neighbours, others0 = token
        now = self.now()
        self._since.pop(instance_id, None)
        self._busy[instance_id] = self._busy.get(instance_id, 0.0) + (now - start)
        if out is None or self._file is None:
            return
        held = now - start
        overlap = (self._others_busy_s(instance_id, now) - others0) / held if held > 0 else 0.0
        chunks, contexts, pad, sampled = plan_shape(plan)
        line = {"system": self.system, "instance": instance_id, "role": role, "t": round(start - self.t0, 6),
                "chunks": chunks, "decodes": contexts, "pad": pad, "sampled": sampled,
                "swapped": len(plan.swap_in) + len(plan.swap_out), "forward_s": out.forward_s,
                "busy_s": out.busy_s, "cpu_s": cpu_s, "neighbours": neighbours, "overlap": round(overlap, 4)}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self.num_lines += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


TARGETS = ("forward_s", "busy_s", "cpu_s")


@dataclass(frozen=True)
class LoggedStep:
    """One line of a step log, as the fit reads it."""

    chunks: tuple[tuple[int, int], ...]
    decodes: tuple[int, ...]
    pad: int
    sampled: int
    seconds: float  # the measured time the fit targets (forward_s unless asked otherwise)
    neighbours: int
    system: str = ""
    role: str = ""
    swapped: int = 0
    t: float = 0.0  # when it started, seconds after its system's start (a speed trace's windows)

    @property
    def rows(self) -> int:
        return sum(n for n, _ in self.chunks) + len(self.decodes) + self.pad

    @property
    def kind(self) -> str:
        """prefill (chunks only), decode (decode rows only) or mixed (both)."""
        if self.chunks and self.decodes:
            return "mixed"
        return "prefill" if self.chunks else "decode"


def logged_step(d: dict, target: str = "forward_s") -> LoggedStep:
    """One parsed step-log line as the fit reads it (KeyError, ValueError or TypeError if it is not one)."""
    return LoggedStep(tuple((int(n), int(s)) for n, s in d["chunks"]), tuple(int(c) for c in d["decodes"]),
                      int(d["pad"]), int(d["sampled"]), float(d[target]), int(d["neighbours"]),
                      d.get("system", ""), d.get("role", ""), int(d.get("swapped", 0)), float(d.get("t", 0.0)))


def read_steps(paths: Iterable, target: str = "forward_s", systems: Optional[set] = None) -> list[LoggedStep]:
    """Every step of the logs at ``paths`` (of ``systems`` only, if given) with its ``target`` time."""
    if target not in TARGETS:
        raise ValueError(f"bad step-log target {target!r}: choose one of {', '.join(TARGETS)}")
    steps = []
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read step log {str(path)!r}: {e.strerror}") from None
        for k, text in enumerate(lines, 1):
            if not text.strip():
                continue
            try:
                step = logged_step(json.loads(text), target)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{k}: not a step-log line ({type(e).__name__}: {e})") from None
            if systems is None or step.system in systems:
                steps.append(step)
    return steps
