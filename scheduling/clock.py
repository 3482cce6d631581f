"""Injected time. Policies, netemu and the cluster read time only through a ``Clock``."""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""


class MonotonicClock:
    """The real clock: ``time.monotonic``."""

    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock tests move by hand; it never sleeps."""

    def __init__(self, start: float = 0.0):
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        assert seconds >= 0
        self.t += seconds
        return self.t
