"""Flip policies: when should a prefill instance become a decode instance, or back (TetriInfer §3.5).

The control plane's transition watcher calls ``decide(now, views)`` every few hundred ms with one
``InstanceView`` per instance and carries out at most one ``FlipDecision`` at a time (drain, then
switch the role variable; see ``aserve.cluster.cluster.Cluster.flip``). Policies only decide: they never
touch instances, so they are tested with made-up views and a fake clock.

* ``off``   never flips.
* ``idle``  the paper's trigger: an instance whose own load stayed at zero for ``idle_s`` (the
            paper: a minute) flips to the other role, if that role has work waiting and its own
            role keeps at least one active instance.
* ``ratio`` keeps the prefill:decode instance ratio near the ratio of prefill to decode work over
            a sliding window. Work is busy seconds (the same measure as the paper's resource
            usage time) plus the backlog each role still holds: queued prompt tokens times the
            measured seconds per prefill token, and requests waiting for a decode slot times the
            measured seconds per decode token's step. The target is ``round(N * Wp / (Wp + Wd))``
            prefill instances, kept in ``[1, N - 1]``; a flip waits for ``cooldown_s`` after the
            previous one, and nothing flips while the cluster is nearly idle.
            Hysteresis: the prefill share of the work must pass the midpoint between the current
            split and the next by ``band`` (a share of the cluster) before an instance moves, so
            a share hovering at a midpoint does not flap; and an instance keeps a role at least
            ``dwell_s`` (its own clock, from its last flip) before it is chosen to move again.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

ROLES = ("prefill", "decode")


def other_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"only prefill and decode instances flip, not {role!r}")
    return ROLES[1 - ROLES.index(role)]


@dataclass(frozen=True)
class InstanceView:
    """What a flip policy may know about one instance. Busy seconds are cumulative, split by the
    role the instance had while it computed (a flipped instance keeps both histories)."""

    id: str
    role: str  # prefill | decode | coupled
    state: str  # active | draining | flipping | failed | removed
    prefill_busy_s: float = 0.0
    decode_busy_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens computed, cumulative
    decode_tokens: int = 0  # output tokens computed, cumulative
    queued_tokens: int = 0  # prefill: prompt tokens waiting
    decode_requests: int = 0  # decode: requests held (running, waiting, incoming)
    decode_waiting: int = 0  # decode: requests waiting for a slot

    @property
    def load(self) -> int:
        return self.queued_tokens if self.role == "prefill" else self.decode_requests


@dataclass(frozen=True)
class FlipDecision:
    instance_id: str
    to_role: str
    reason: str


class FlipPolicy:
    name = "off"

    def decide(self, now: float, views: Sequence[InstanceView]) -> Optional[FlipDecision]:
        return None

    def note_flip(self, now: float, instance_id: Optional[str] = None) -> None:
        """A flip happened (whoever asked for it); policies with a cooldown restart it."""


def _active(views: Sequence[InstanceView], role: str) -> list[InstanceView]:
    return [v for v in views if v.role == role and v.state == "active"]


class IdleFlipPolicy(FlipPolicy):
    """Flip an instance idle for ``idle_s`` towards the role that has work waiting."""

    name = "idle"

    def __init__(self, idle_s: float = 60.0):
        if idle_s <= 0:
            raise ValueError(f"flip idle_s must be > 0, got {idle_s}")
        self.idle_s = idle_s
        self._busy_at: dict[str, float] = {}  # last time each instance had load (or was seen first)

    def decide(self, now: float, views: Sequence[InstanceView]) -> Optional[FlipDecision]:
        for v in views:
            if v.load > 0 or v.id not in self._busy_at or v.state != "active":
                self._busy_at[v.id] = now
        for v in sorted(views, key=lambda v: v.id):
            if v.state != "active" or v.role not in ROLES or now - self._busy_at[v.id] < self.idle_s:
                continue
            peers, others = _active(views, v.role), _active(views, other_role(v.role))
            if len(peers) > 1 and others and any(o.load > 0 for o in others):
                idle_for, self._busy_at[v.id] = now - self._busy_at[v.id], now  # once per idle spell
                return FlipDecision(v.id, other_role(v.role), f"idle for {idle_for:.0f}s")
        return None


class RatioFlipPolicy(FlipPolicy):
    """Keep #prefill : #decode near prefill work : decode work over the last ``window_s``."""

    name = "ratio"

    def __init__(self, window_s: float = 10.0, cooldown_s: Optional[float] = None, min_busy: float = 0.2,
                 prefill_s_per_token: float = 1e-3, decode_s_per_token: float = 2e-3, band: float = 0.0,
                 dwell_s: Optional[float] = None):
        if window_s <= 0 or min_busy < 0:
            raise ValueError(f"flip window_s must be > 0 and min_busy >= 0, got {window_s}, {min_busy}")
        if not 0 <= band < 0.5:
            raise ValueError(f"flip band must be in [0, 0.5), got {band}")
        self.window_s = window_s
        self.cooldown_s = window_s if cooldown_s is None else cooldown_s
        self.band = band
        self.dwell_s = window_s if dwell_s is None else dwell_s
        self._role_since: dict[str, float] = {}  # instance -> when it took its role (or was first seen)
        self.min_busy = min_busy  # fraction of one instance-window below which nothing flips
        self.prior = (prefill_s_per_token, decode_s_per_token)  # until measured
        self._history: deque[tuple[float, float, float, int, int]] = deque()
        self._last_flip = float("-inf")
        self._started: Optional[float] = None
        self.last_work: tuple[float, float] = (0.0, 0.0)  # (prefill, decode) seconds: for logs and tests

    def note_flip(self, now: float, instance_id: Optional[str] = None) -> None:
        self._last_flip = now
        if instance_id is not None:
            self._role_since[instance_id] = now

    def decide(self, now: float, views: Sequence[InstanceView]) -> Optional[FlipDecision]:
        totals = (sum(v.prefill_busy_s for v in views), sum(v.decode_busy_s for v in views),
                  sum(v.prefill_tokens for v in views), sum(v.decode_tokens for v in views))
        self._history.append((now, *totals))
        while len(self._history) > 1 and self._history[1][0] <= now - self.window_s:
            self._history.popleft()
        if self._started is None:
            self._started = now
        for v in views:
            self._role_since.setdefault(v.id, now)
        t0, p0, d0, pt0, dt0 = self._history[0]
        if now - self._started < self.window_s or now - self._last_flip < self.cooldown_s:
            return None
        if any(v.state in ("draining", "flipping") for v in views):
            return None
        prefill, decode = _active(views, "prefill"), _active(views, "decode")
        n = len(prefill) + len(decode)
        if n < 2 or not prefill or not decode:
            return None
        s_prefill = totals[0] / totals[2] if totals[2] else self.prior[0]
        s_decode = totals[1] / totals[3] if totals[3] else self.prior[1]
        work_p = totals[0] - p0 + s_prefill * sum(v.queued_tokens for v in prefill)
        work_d = totals[1] - d0 + s_decode * sum(v.decode_waiting for v in decode)
        self.last_work = (work_p, work_d)
        if work_p + work_d < self.min_busy * (now - t0 or self.window_s):
            return None
        target = self._target(n, len(prefill), work_p / (work_p + work_d))
        share = f"prefill work {work_p:.2f}s vs decode {work_d:.2f}s over {now - t0:.1f}s"
        settled = lambda v: now - self._role_since[v.id] >= self.dwell_s  # noqa: E731
        if target > len(prefill):
            movable = [v for v in decode if settled(v)]
            if movable:
                victim = min(movable, key=lambda v: (v.decode_requests, v.id))
                return FlipDecision(victim.id, "prefill", f"{share}: want {target} prefill instances")
        if target < len(prefill):
            movable = [v for v in prefill if settled(v)]
            if movable:
                victim = min(movable, key=lambda v: (v.queued_tokens, v.id))
                return FlipDecision(victim.id, "decode", f"{share}: want {target} prefill instances")
        return None

    def _target(self, n: int, num_prefill: int, share: float) -> int:
        """Prefill instances wanted for a prefill work ``share``: one more only once the share
        passes the midpoint to that split by ``band``, one fewer only once it falls that far
        below the midpoint to the split under it; always in ``[1, n - 1]``."""
        target = num_prefill
        while target < n - 1 and share > (target + 0.5) / n + self.band:
            target += 1
        while target > 1 and share < (target - 0.5) / n - self.band:
            target -= 1
        return target
