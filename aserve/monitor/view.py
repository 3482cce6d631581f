"""The live monitor's frame: a ``View`` (aserve/monitor/history.py) drawn with rich.

    aserve · disagg · smollm2-135m-instruct · up 0m48s · http://127.0.0.1:8765       header
    inst dev role    wait sch rcv run          KV pre/s dec/s busy   pred         instances
    p0   cpu prefill    7   4   -   5 █████▏  86%   128     0  54% oracle
    link  profile  bytes/s in flight emulated/xfer real copy/xfer                 links
    p0→d1 nvlink  8.8 MB/s         0           6ms            6ms
    requests 15 in flight (11 waiting)  finished 17  failed 0  aborted 0  lag 1ms cluster
    TTFT p50 17.00s p99 39.30s   TBT p50 119ms p99 4.44s   last 14s, 7 req
    tokens/s   148 ▂▅██▇█▅▂▁▇▅▂▂▅                                                 sparkline
    02:51:30 preemption d1: 1 request(s) preempted                                events

Compact mode fits ``height`` lines (an 80x24 terminal): instance and link rows past the
budget fold into a "+N more" caption line, and events get whatever lines are left. Every
line is no-wrap with an ellipsis, so no line is ever wider than the console.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from aserve.monitor.data import sparkline
from aserve.monitor.history import ClusterRow, Event, InstanceRow, LinkRow, View

STATE_STYLE = {"active": "", "draining": "yellow", "flipping": "magenta", "failed": "bold red"}
FULL_EVENTS = 12
EIGHTHS = "▏▎▍▌▋▊▉"  # 1/8 .. 7/8 of a cell


# ---- number formats ------------------------------------------------------------------------------
def fmt_count(n: Optional[float]) -> str:
    if n is None:
        return "-"
    if n >= 10_000:
        return f"{n / 1000:.0f}k"
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def fmt_seconds(s: Optional[float]) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f}ms" if s < 1 else f"{s:.2f}s"


def fmt_bytes_rate(b: Optional[float]) -> str:
    if b is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1000:
            return f"{b:.0f} {unit}/s" if unit == "B" else f"{b:.1f} {unit}/s"
        b /= 1000
    return f"{b:.1f} TB/s"


def fmt_uptime(s: float) -> str:
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def fmt_event_time(t: float) -> str:
    """Wall-clock time for unix timestamps; server-relative ``+12.3s`` for anything smaller."""
    return time.strftime("%H:%M:%S", time.localtime(t)) if t > 1e9 else f"+{t:.1f}s"


def kv_bar(usage: float, width: int = 6) -> Text:
    """``usage`` (0..1) as ``width`` cells filled in eighths, so 1% already shows."""
    eighths = round(min(max(usage, 0.0), 1.0) * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + (EIGHTHS[part - 1] if part else "")
    style = "green" if usage < 0.7 else "yellow" if usage < 0.9 else "red"
    return Text.assemble((bar, style), ("░" * (width - len(bar)), "dim"), f" {usage * 100:3.0f}%")


def _line(*parts) -> Text:
    text = Text.assemble(*parts)
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


# ---- sections ----------------------------------------------------------------------------------
def _table(compact: bool, title: str, num_left: int, *headers: str) -> Table:
    """Names in the first ``num_left`` columns (left-aligned), numbers in the rest."""
    # exactly one space between columns (the box's divider, or left padding without a box) and
    # none at the edges: the instance table needs 80 columns with a "decode draining" role
    t = Table(box=None if compact else box.SIMPLE_HEAD, title=None if compact else title,
              padding=(0, 0, 0, 1) if compact else 0, pad_edge=False, show_edge=False, header_style="bold",
              title_justify="left", title_style="bold cyan", caption_justify="left", caption_style="dim")
    for i, h in enumerate(headers):
        t.add_column(h, no_wrap=True, overflow="ellipsis", justify="left" if i < num_left else "right")
    return t


def _fit(t: Table, rows: Sequence, budget: Optional[int]) -> Sequence:
    """The rows that fit ``budget`` lines; when some are cut, a caption line says how many."""
    if budget is None or len(rows) <= budget:
        return rows
    keep = max(0, budget - 1)
    t.caption = f"+{len(rows) - keep} more"
    return rows[:keep]


def instances_table(rows: Sequence[InstanceRow], compact: bool, budget: Optional[int] = None) -> Table:
    t = _table(compact, "instances", 3, "inst", "dev", "role", "wait", "sch", "rcv", "run", "KV",
               "pre/s", "dec/s", "busy", "pred")
    for r in _fit(t, rows, budget):
        role = Text(r.role)
        if r.state != "active":  # draining, flipping, failed: whatever the server says
            role.append(f" {r.state}", STATE_STYLE.get(r.state, "bold yellow"))
        t.add_row(r.id, r.device, role, *(fmt_count(n) for n in (r.num_waiting, r.num_scheduled, r.num_receiving,
                                                                   r.num_running)),
                  kv_bar(r.kv_usage), fmt_count(r.prefill_tps), fmt_count(r.decode_tps),
                  "-" if r.busy is None else f"{r.busy * 100:.0f}%", r.predictor or "-")
    return t


def links_table(rows: Sequence[LinkRow], compact: bool, budget: Optional[int] = None) -> Table:
    t = _table(compact, "KV links", 2, "link", "profile", "bytes/s", "in flight", "emulated/xfer", "real copy/xfer")
    # the busiest links first: they are the ones worth a row when rows are scarce
    ordered = sorted(rows, key=lambda r: (-(r.bytes_per_s or 0.0), -r.in_flight, r.name))
    for r in _fit(t, ordered, budget):
        t.add_row(r.name, r.profile, fmt_bytes_rate(r.bytes_per_s), str(r.in_flight),
                  fmt_seconds(r.emulated_s_per_transfer), fmt_seconds(r.real_s_per_transfer))
    return t


def cluster_lines(c: ClusterRow, width: int) -> list[Text]:
    counts = c.counts
    # rejections are counted only by servers that count them; other counts surface as events
    extra = [(f"  rejected {counts['rejected']}", "yellow")] if "rejected" in counts else []
    line1 = _line(("requests ", "bold"), f"{c.num_requests} in flight ({c.num_waiting} waiting)  ",
                  f"finished {counts.get('finished', 0)}  ",
                  (f"failed {counts.get('failed', 0)}", "red" if counts.get("failed") else ""),
                  f"  aborted {counts.get('aborted', 0)}", *extra, f"  lag {fmt_seconds(c.loop_lag_s)}",
                  *([f"  prefix hits {c.prefix_hit_rate:.0%}"] if c.prefix_hit_rate is not None else []))
    window = (f"last {c.window_s:.0f}s, {c.num_window_requests} req" if c.window_s > 0
              else "window starts at the next sample")
    line2 = _line(("TTFT ", "bold"), f"p50 {fmt_seconds(c.ttft[0])} p99 {fmt_seconds(c.ttft[1])}   ",
                  ("TBT ", "bold"), f"p50 {fmt_seconds(c.tbt[0])} p99 {fmt_seconds(c.tbt[1])}   ", (window, "dim"))
    head = f"tokens/s {fmt_count(c.tokens_per_s):>5} "
    line3 = _line(("tokens/s ", "bold"), f"{fmt_count(c.tokens_per_s):>5} ",
                  (sparkline(list(c.throughput), max(1, width - len(head))), "cyan"))
    return [line1, line2, line3]


def event_lines(events: Sequence[Event], budget: int) -> list[Text]:
    if budget <= 0:
        return []
    if not events:
        return [_line(("no events yet", "dim"))]
    style = {"failed": "bold red", "rejected": "red", "preemption": "yellow", "flip": "magenta"}
    return [_line((fmt_event_time(e.time), "dim"), " ", (f"{e.kind:<10}", style.get(e.kind, "cyan")), " ", e.message)
            for e in list(events)[-budget:]]


# ---- the frame -----------------------------------------------------------------------------------
def header(view: Optional[View], source: str) -> Text:
    if view is None:
        return _line(("aserve monitor", "bold"), f" · {source}")
    return _line(("aserve", "bold"), f" · {view.mode} · {view.model} · up {fmt_uptime(view.uptime_s)} · ",
                 (source, "dim"))


def render(view: Optional[View], source: str, status: Optional[str] = None, *, compact: bool = False,
           width: int = 80, height: int = 24) -> RenderableType:
    """One frame. ``status`` (e.g. "connection lost ...") shows in red under the header, over
    the last good data; ``view`` None means nothing was ever received."""
    parts: list[RenderableType] = [header(view, source)]
    if status:
        parts.append(_line((status, "bold red")))
    if view is None:
        return Group(*parts)
    num_insts, num_links = len(view.instances), len(view.links)
    inst_budget = link_budget = event_budget = None
    if compact:  # lines left for rows, after the tables' headers and the cluster lines
        room = height - len(parts) - 1 - (1 if num_links else 0) - 3
        inst_budget = max(1, min(num_insts, room - min(num_links, 2) - 1))  # leave two link lines, one event
        link_budget = max(1, min(num_links, room - inst_budget - 1))
        event_budget = max(0, room - inst_budget - (link_budget if num_links else 0))
    parts.append(instances_table(view.instances, compact, inst_budget))
    if num_links:
        parts.append(links_table(view.links, compact, link_budget))
    parts.extend(cluster_lines(view.cluster, width))
    parts.extend(event_lines(view.events, FULL_EVENTS if event_budget is None else event_budget))
    return Group(*parts)
