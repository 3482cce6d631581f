"""Progress of a long predictor step (a backbone pass over thousands of prompts), on stderr.

A first ``replay --predictor lm`` on a fresh machine once spent 766 s fitting on 8,428 prompts
with nothing on screen but the line that announced it (issue 25). A step that can take minutes
says how far it is and how long it has left, wherever stderr goes:

    terminal   a rich bar:  backbone features ━━━━━━╸━━━━━━  1024/8428  0:01:31  ETA 0:10:58
    elsewhere  a line every 10% of the work (logs, CI, a captured stderr: a live bar shows nothing there)
               lm: backbone features 1024/8428 (12%), 91 s elapsed, ETA 658 s

The ETA is the rate so far times what is left: steps here cost about the same per item.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

STEPS = 10  # plain lines: one per tenth of the work


class StepProgress:
    """``with StepProgress("lm: backbone features", total) as p: ... p.advance(n)``."""

    def __init__(self, what: str, total: int, stream: Optional[TextIO] = None, clock=time.perf_counter):
        if total < 0:
            raise ValueError(f"progress total must be >= 0, got {total}")
        self.what, self.total, self.done = what, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self._clock, self._start, self._next_line, self._bar = clock, 0.0, 0, None

    def __enter__(self) -> "StepProgress":
        self._start = self._clock()
        if self.total and _is_terminal(self.stream):
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("ETA"), TimeRemainingColumn())
            self._bar = Progress(*columns, console=Console(file=self.stream))
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total)
        elif self.total:
            self._line()
        return self

    def advance(self, n: int) -> None:
        self.done = min(self.total, self.done + n)
        if not self.total:  # nothing worth showing (the caller passed 0 for a short step)
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=n)
        elif self.done >= self._next_line:
            self._line()

    def eta_s(self) -> Optional[float]:
        """Seconds left at the rate so far (None before the first item is done)."""
        if not self.done:
            return None
        return (self._clock() - self._start) / self.done * (self.total - self.done)

    def _line(self) -> None:
        eta = self.eta_s()
        tail = "starting" if eta is None else f"{self._clock() - self._start:.0f} s elapsed, ETA {eta:.0f} s"
        print(f"{self.what} {self.done}/{self.total} ({self.done / self.total:.0%}), {tail}",
              file=self.stream, flush=True)
        step = max(1, -(-self.total // STEPS))
        self._next_line = min(self.total, (self.done // step + 1) * step)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self.total and self.done < self._next_line and not exc[0]:
            self._line()  # the last line says it finished, even when the work ended between steps


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
