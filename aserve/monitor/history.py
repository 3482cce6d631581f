"""The live monitor's memory: the samples it keeps, and the rows and events a frame shows.

    Sample ──History.add──► samples (last two: rates; oldest in the window: quantiles)
                            throughput series (sparkline), event log ──History.view──► View

Events come from two places: the server's own ``events`` list in /v1/stats (flips, failures,
re-runs, as the cluster logs them), and changes between two samples that no log reports
(preemptions, aborts, rejections, draining and flipping marks).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from aserve.monitor.data import TBT, TTFT, Histogram, Sample, histogram_delta, p50_p99, rate


# ---- rows ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InstanceRow:
    id: str
    device: str
    role: str
    state: str
    num_waiting: Optional[int]
    num_scheduled: Optional[int]  # None: the role has no such stage (shown as "-")
    num_receiving: Optional[int]
    num_running: Optional[int]
    kv_usage: float  # 0..1 of the instance's KV blocks in use
    prefill_tps: Optional[float]  # None until two samples exist
    decode_tps: Optional[float]
    busy: Optional[float]  # 0..1 of wall time the device was computing
    predictor: Optional[str]


@dataclass(frozen=True)
class LinkRow:
    name: str  # "src→dst"
    profile: str
    bytes_per_s: Optional[float]
    in_flight: int
    emulated_s_per_transfer: Optional[float]  # mean over the link's life; None before any transfer
    real_s_per_transfer: Optional[float]


@dataclass(frozen=True)
class Event:
    time: float  # unix time when known, else the server's uptime
    kind: str  # flip | state | preemption | failed | aborted | rejected | ... (server events: theirs)
    message: str


@dataclass(frozen=True)
class ClusterRow:
    num_requests: int
    num_waiting: int
    counts: dict  # finished / failed / aborted (and whatever else the server counts)
    ttft: tuple[Optional[float], Optional[float]]  # p50, p99 over the window
    tbt: tuple[Optional[float], Optional[float]]
    num_window_requests: int  # TTFT observations in the window
    window_s: float  # the span the quantiles really cover (0: no window yet)
    tokens_per_s: Optional[float]  # prompt + generated, all instances
    throughput: tuple[float, ...]  # recent tokens/s, oldest first
    loop_lag_s: float
    prefix_hit_rate: Optional[float] = None  # prompt tokens found in the prefix cache, since start


@dataclass(frozen=True)
class View:
    """Everything one frame shows."""

    model: str
    mode: str
    uptime_s: float
    instances: tuple[InstanceRow, ...]
    links: tuple[LinkRow, ...]
    cluster: ClusterRow
    events: tuple[Event, ...]  # newest last


def _by_id(stats: dict) -> dict[str, dict]:
    return {i["id"]: i for i in stats.get("instances", ())}


def _link_name(link: dict) -> str:
    return f"{link['src']}→{link['dst']}"


def _kv_usage(inst: dict) -> float:
    total = inst.get("total_blocks") or 0
    return 1.0 - inst.get("free_blocks", total) / total if total else 0.0


def instance_rows(old: Optional[Sample], new: Sample) -> tuple[InstanceRow, ...]:
    dt = new.time - old.time if old is not None else 0.0
    before = _by_id(old.stats) if old is not None else {}
    rows = []
    for i in new.stats.get("instances", ()):
        prev = before.get(i["id"], {})
        busy = rate(prev.get("busy_s"), i.get("busy_s"), dt)
        rows.append(InstanceRow(
            i["id"], str(i.get("device", "?")), i.get("role", "?"), str(i.get("state", "?")),
            i.get("num_waiting"), i.get("num_scheduled"), i.get("num_receiving"), i.get("num_running"),
            _kv_usage(i),
            rate(prev.get("num_prefill_tokens"), i.get("num_prefill_tokens"), dt),
            rate(prev.get("num_decode_tokens"), i.get("num_decode_tokens"), dt),
            # a step's seconds are booked when it ends, so one window can hold a little more than dt
            None if busy is None else min(1.0, busy), i.get("predictor")))
    return tuple(rows)


def link_rows(old: Optional[Sample], new: Sample) -> tuple[LinkRow, ...]:
    dt = new.time - old.time if old is not None else 0.0
    before = {_link_name(link): link for link in old.stats.get("links", ())} if old is not None else {}
    rows = []
    for link in new.stats.get("links", ()):
        name, done = _link_name(link), link.get("num_done", 0)
        rows.append(LinkRow(
            name, link.get("profile", "?"), rate(before.get(name, {}).get("bytes"), link.get("bytes"), dt),
            int(link.get("in_flight", 0)),
            link.get("emulated_s", 0.0) / done if done else None,
            link.get("real_copy_s", 0.0) / done if done else None))
    return tuple(rows)


def total_tokens(stats: dict) -> float:
    return sum(i.get("num_prefill_tokens", 0) + i.get("num_decode_tokens", 0) for i in stats.get("instances", ()))


# ---- events ---------------------------------------------------------------------------------------
def derived_events(old: Sample, new: Sample) -> list[Event]:
    """What changed between two samples that an operator wants to hear about.

    Preemptions, aborts, rejections and draining/flipping marks are never in the server's own
    ``events`` log, so they always come from here; flips, failures and new instances come from
    here only when the server keeps no log (with one, they would show twice).
    """
    t, events, logged = new.wall, [], "events" in new.stats
    before = _by_id(old.stats)
    num_role_changes = 0
    for i in new.stats.get("instances", ()):
        prev, iid = before.get(i["id"]), i["id"]
        if prev is None:
            if not logged:
                events.append(Event(t, "instance", f"{iid} joined as {i.get('role')}"))
            continue
        if prev.get("role") != i.get("role"):
            num_role_changes += 1
            if not logged:
                events.append(Event(t, "flip", f"{iid} flipped {prev.get('role')} → {i.get('role')}"))
        state = i.get("state")
        if prev.get("state") != state and not (logged and state == "failed"):
            why = f": {i['failure']}" if state == "failed" and i.get("failure") else ""
            events.append(Event(t, "failed" if state == "failed" else "state",
                                f"{iid} {prev.get('state')} → {state}{why}"))
        preempted = i.get("num_preemptions", 0) - prev.get("num_preemptions", 0)
        if preempted > 0:
            events.append(Event(t, "preemption", f"{iid}: {preempted} request(s) preempted"))
    if not logged:  # flips back and forth within one interval leave no role change to see
        unseen = new.stats.get("num_flips", 0) - old.stats.get("num_flips", 0) - num_role_changes
        if unseen > 0:
            events.append(Event(t, "flip", f"{unseen} more role flip(s)"))
    events += _count_events(old.stats, new.stats, t, logged)
    return events


def _count_events(old: dict, new: dict, t: float, logged: bool) -> list[Event]:
    events = []
    kinds = ("aborted",) if logged else ("aborted", "rejected", "failed")  # the log has rejections
    old_counts, new_counts = old.get("counts", {}), new.get("counts", {})
    for key in kinds:
        n = new_counts.get(key, 0) - old_counts.get(key, 0)
        if n > 0:
            events.append(Event(t, key, f"{n} request(s) {key}"))
    if logged:
        return events
    old_links = {_link_name(link): link for link in old.get("links", ())}
    for link in new.get("links", ()):
        n = link.get("num_failed", 0) - old_links.get(_link_name(link), {}).get("num_failed", 0)
        if n > 0:
            events.append(Event(t, "failed", f"link {_link_name(link)}: {n} transfer(s) failed"))
    return events


def server_events(stats: dict) -> list[Event]:
    """The server's own ``events`` list, when it keeps one; anything malformed is skipped."""
    out = []
    for e in stats.get("events") or ():
        if isinstance(e, dict) and {"time", "kind", "message"} <= e.keys():
            out.append(Event(float(e["time"]), str(e["kind"]), str(e["message"])))
    return out


# ---- history ------------------------------------------------------------------------------------
class History:
    """The samples a frame needs: the last two for rates, a sliding window for quantiles,
    the throughput series for the sparkline, and the event log."""

    def __init__(self, window_s: float = 30.0, max_events: int = 50, max_throughput: int = 120):
        assert window_s > 0, window_s
        self.window_s = window_s
        self.samples: deque[Sample] = deque()
        self.throughput: deque[float] = deque(maxlen=max_throughput)
        self.events: deque[Event] = deque(maxlen=max_events)
        self._logged: set = set()  # the server's events in the last sample: a rolling log repeats them

    def add(self, sample: Sample) -> None:
        last = self.samples[-1] if self.samples else None
        if last is not None and sample.time < last.time:  # uptime went back: a new server
            self.samples.clear()
            self.throughput.clear()
            self.events.append(Event(sample.wall, "restart", "server restarted: rates and windows start over"))
            last = None
        logged = server_events(sample.stats)
        self.events.extend(e for e in logged if e not in self._logged)
        self._logged = set(logged)
        if last is not None:
            self.events.extend(derived_events(last, sample))
            tps = rate(total_tokens(last.stats), total_tokens(sample.stats), sample.time - last.time)
            if tps is not None:
                self.throughput.append(tps)
        self.samples.append(sample)
        # keep the newest sample at least window_s old: it is the window's base
        while len(self.samples) > 2 and self.samples[1].time <= sample.time - self.window_s:
            self.samples.popleft()

    def view(self) -> View:
        assert self.samples, "add a sample first"
        new = self.samples[-1]
        prev = self.samples[-2] if len(self.samples) > 1 else None
        base = self.samples[0] if prev is not None else None
        stats = new.stats
        return View(stats.get("model", "?"), stats.get("mode", "?"), new.time,
                    instance_rows(prev, new), link_rows(prev, new),
                    self._cluster(base, new), tuple(self.events))

    def _cluster(self, base: Optional[Sample], new: Sample) -> ClusterRow:
        def window(name: str) -> Optional[Histogram]:
            if base is None or name not in new.histograms:
                return None
            return histogram_delta(base.histograms.get(name), new.histograms[name])

        ttft, tbt = window(TTFT), window(TBT)
        s = new.stats
        return ClusterRow(
            int(s.get("num_requests", 0)), int(s.get("num_waiting", 0)), dict(s.get("counts", {})),
            p50_p99(ttft), p50_p99(tbt), int(ttft.total) if ttft is not None else 0,
            new.time - base.time if base is not None else 0.0,
            self.throughput[-1] if self.throughput else None, tuple(self.throughput),
            float(s.get("loop_lag_s", 0.0)), (s.get("prefix_cache") or {}).get("hit_rate"))
