"""``LinkModel``: when would each transfer on a shared link finish? Pure Python, injected clock.

Processor sharing: the transfers that still have bytes to move split the bandwidth equally.
A transfer's *work* is ``nbytes * num_copies`` (every hop of an indirect path moves the bytes
again); when its work is done it still waits ``num_copies * latency`` before it lands, and it
no longer takes bandwidth during that tail.

```
 bw │ A alone │ A and B, bw/2 each │ B alone │
    ├─────────┼────────────────────┼─────────┤──── t
    t0        t1 (B starts)        tA_data   tB_data
                                   └ A finishes at tA_data + latency
```

The model keeps, per transfer, the work left as of ``_t``; every public call first advances
the state to ``clock.now()`` piecewise (the share changes each time a transfer's data ends).
Projections (``finish_time``) assume nothing else starts or is removed; they move when the set
in flight changes, so a waiter re-asks after it wakes.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Optional

from netemu.profiles import LinkProfile
from scheduling.clock import Clock

# Work below this many bytes counts as done: float subtraction leaves crumbs.
_EPS_BYTES = 1e-6


@dataclass
class _Flight:
    nbytes: int
    work_left: float  # bytes still to push through the link, all hops counted
    data_done_at: Optional[float] = None  # when work_left reached zero


class LinkModel:
    """Bandwidth, latency and fair sharing of one link. Not thread-safe: event-loop thread only."""

    def __init__(self, profile: LinkProfile, clock: Clock):
        self.profile = profile
        self.clock = clock
        self._flights: dict[Hashable, _Flight] = {}
        self._t = clock.now()
        # Counters for metrics.
        self.bytes_moved = 0  # nbytes of transfers removed as completed
        self.num_done = 0
        self.num_aborted = 0
        self.busy_s = 0.0  # link time with at least one transfer moving data

    @property
    def _latency(self) -> float:
        return self.profile.num_copies * self.profile.latency_s

    def start(self, transfer_id: Hashable, nbytes: int) -> None:
        """A transfer of ``nbytes`` enters the link now."""
        if transfer_id in self._flights:
            raise ValueError(f"transfer {transfer_id!r} is already in flight")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        now = self._advance()
        work = float(nbytes * self.profile.num_copies)
        self._flights[transfer_id] = _Flight(nbytes, work, now if work <= _EPS_BYTES else None)

    def finish_time(self, transfer_id: Hashable) -> float:
        """Projected landing time, given what is in flight now (moves when that changes)."""
        self._advance()
        return self._project()[transfer_id]

    def finish_times(self) -> dict[Hashable, float]:
        """Projected landing time of every transfer in flight."""
        self._advance()
        return self._project()

    def remove(self, transfer_id: Hashable, *, completed: bool = True) -> None:
        """Take a transfer off the link: landed (``completed``) or aborted (frees its share)."""
        self._advance()
        flight = self._flights.pop(transfer_id)
        if completed:
            self.bytes_moved += flight.nbytes
            self.num_done += 1
        else:
            self.num_aborted += 1

    def in_flight(self) -> tuple[Hashable, ...]:
        """Ids of the transfers on the link (data moving or in their latency tail)."""
        return tuple(self._flights)

    def num_sharing(self) -> int:
        """How many transfers split the bandwidth right now."""
        self._advance()
        return len(self._active())

    def _active(self) -> list[_Flight]:
        return [f for f in self._flights.values() if f.data_done_at is None]

    def _advance(self) -> float:
        """Move the state to ``clock.now()``, one piece per data completion on the way."""
        now = self.clock.now()
        assert now >= self._t, f"clock went back: {now} < {self._t}"
        while True:
            active = self._active()
            if not active:
                break
            rate = self.profile.bandwidth_bytes_per_s / len(active)
            first = min(f.work_left for f in active)
            t_first = self._t + first / rate
            if t_first > now:
                moved = rate * (now - self._t)
                for f in active:
                    f.work_left -= moved
                self.busy_s += now - self._t
                break
            for f in active:  # every active one moves the same bytes; the smallest end here
                f.work_left -= first
                if f.work_left <= _EPS_BYTES:
                    f.work_left, f.data_done_at = 0.0, t_first
            self.busy_s += t_first - self._t
            self._t = t_first
        self._t = now
        return now

    def _project(self) -> dict[Hashable, float]:
        """Landing times if nothing changes: finish in order of work left, shares growing."""
        ends = {tid: f.data_done_at + self._latency
                for tid, f in self._flights.items() if f.data_done_at is not None}
        pending = sorted(((f.work_left, tid) for tid, f in self._flights.items()
                          if f.data_done_at is None), key=lambda p: p[0])
        t, done_work, n = self._t, 0.0, len(pending)
        bw = self.profile.bandwidth_bytes_per_s
        for i, (work, tid) in enumerate(pending):
            # Between the previous end and this one, n - i transfers share the link.
            t += (work - done_work) * (n - i) / bw
            done_work = work
            ends[tid] = t + self._latency
        return ends

    def stats(self) -> dict[str, float]:
        """Counters for metrics."""
        self._advance()
        return {"in_flight": len(self._flights), "sharing": len(self._active()),
                "bytes_moved": self.bytes_moved, "num_done": self.num_done,
                "num_aborted": self.num_aborted, "busy_s": self.busy_s}
