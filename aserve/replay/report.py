"""Replay metrics: per request, per system, side by side (rich table) and as JSON.

Per request: TTFT (arrival -> first token), TPOT (its mean time per output token after the
first), every token gap (time between two consecutive tokens of one request), JCT (arrival ->
last token), normalized latency (JCT / output tokens), queue time (arrival -> first scheduled).
Per system: mean/p50/p90/p99/p99.9/max of each (TPOT over requests, token gaps over every gap:
the two are named apart, since a mean of TPOTs hides the rare long gap that the gap percentiles
and the max show), throughput, goodput under an SLO, resource usage and perf/$, generation
stalls (gaps over 5x the median gap), padding, KV bytes moved, flips. Under an SLO
(aserve/replay/slo.py): attainment (the share of requests that completed and met every limit),
``request_goodput`` (good requests per second, vLLM's name), goodput per device, and how many
requests missed each limit.

*Resource usage* is the sum over instances of the wall seconds each one's executor spent on
model steps (the paper's "resource usage time"). *perf/$* follows the paper's "performance per
dollar", perf/$ ∝ throughput / resource usage: output tokens per second divided by resource
usage seconds, reported as a ratio to the first system (cost ∝ busy device time).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from aserve.replay.slo import ATTAINMENT_TARGET, Slo, attainment
from scheduling.stalls import count_stalls

STALL_K = 5.0  # a stall: a token gap longer than STALL_K x the median gap (Sarathi-Serve)
LATENCIES = ("ttft", "tpot", "token_gap", "jct", "normalized_latency", "queue_time")


@dataclass(frozen=True)
class RequestRecord:
    """What one replayed request did. Times are seconds on the replay's clock (0 = its start)."""

    index: int
    prompt_tokens: int
    target_output_tokens: int
    arrival_s: float
    status: str  # completed | failed | aborted
    scheduled_s: Optional[float] = None
    first_token_s: Optional[float] = None
    finish_s: Optional[float] = None
    token_times: tuple = ()
    num_preemptions: int = 0
    error: Optional[str] = None
    reported_output_tokens: Optional[int] = None  # over HTTP: the server's usage count, when it differs
    cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache (None: not known)

    def __post_init__(self):
        assert self.status in ("completed", "failed", "aborted"), self.status

    @property
    def output_tokens(self) -> int:
        return self.reported_output_tokens if self.reported_output_tokens is not None else len(self.token_times)


@dataclass(frozen=True)
class InstanceRecord:
    """One instance over a replay; ``samples`` are (t, busy_s so far, role) every sample period."""

    id: str
    role: str
    busy_s: float
    prefill_tokens: int = 0
    decode_tokens: int = 0
    pad_tokens: int = 0
    free_blocks_start: int = 0
    free_blocks_end: int = 0
    samples: tuple = ()


@dataclass(frozen=True)
class SystemRun:
    """One system's replay of a trace."""

    name: str
    records: tuple
    instances: tuple = ()  # empty over HTTP: the server's internals are not visible
    kv_bytes_moved: Optional[int] = None
    flips: Optional[int] = None
    max_loop_lag_s: Optional[float] = None
    config: dict = field(default_factory=dict)
    flip_log: tuple = ()  # each flip: instance, from, to, drain_s, flip_s (the switch alone), reason
    # KV hand-overs: bytes, num_done, real_copy_s (the real copy: threads, or Ray between processes)
    # and emulated_s (what the link model made them last), summed over the replay
    kv_transfer: Optional[dict] = None
    failures: tuple = ()  # each instance failure: instance, why, requests it held, recovered_s
    predictor: Optional[dict] = None  # the online length predictor over the trace's requests (not warm-up)
    wall_s: Optional[float] = None  # host seconds the replay took (a simulated one runs faster than its clock)
    # adaptive: prompts placed on each role, prefilled requests kept where prefilled, prompts taken
    # by another instance before they started (aserve/cluster/adaptive.py, AdaptivePlacer.late_bind)
    placements: Optional[dict] = None
    # adaptive: each decode moved by its KV that landed (rebalance or --kv-relief): "at" (seconds since
    # the replay started), request, from, to, why
    move_log: tuple = ()
    vllm: dict = field(default_factory=dict)  # over HTTP: vllm bench serve's fields (aserve/replay/vllm_names.py)
    devices: Optional[int] = None  # devices the system ran on (None: its instances, where known)
    cache_evictions: Optional[int] = None  # cached blocks evicted from the prefix cache (None: not known)

    @property
    def num_devices(self) -> Optional[int]:
        return self.devices if self.devices is not None else (len(self.instances) or None)


def stats(values: Sequence[float]) -> Optional[dict]:
    if len(values) == 0:
        return None
    a = np.asarray(values, dtype=float)
    p50, p90, p99, p999 = np.percentile(a, [50, 90, 99, 99.9])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "p999": float(p999),
            "max": float(a.max())}


def request_latencies(r: RequestRecord) -> dict:
    """Latency samples of one completed request (lists, since it has many token gaps)."""
    gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:])]
    out = {"ttft": [r.first_token_s - r.arrival_s], "tpot": [tpot(r)] if gaps else [], "token_gap": gaps,
           "jct": [r.finish_s - r.arrival_s],
           "normalized_latency": [(r.finish_s - r.arrival_s) / max(1, r.output_tokens)], "queue_time": []}
    if r.scheduled_s is not None:
        out["queue_time"] = [r.scheduled_s - r.arrival_s]
    return out


def tpot(r: RequestRecord) -> float:
    """The request's mean time per output token after the first (0 with a single token)."""
    return (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) if len(r.token_times) > 1 else 0.0


def summarize(run: SystemRun, slo: Optional[Slo] = None, clipped: int = 0) -> dict:
    """One system's numbers, in the JSON report's shape (seconds)."""
    done = [r for r in run.records if r.status == "completed" and r.first_token_s is not None]
    samples = {k: [] for k in LATENCIES}
    for r in done:
        for k, v in request_latencies(r).items():
            samples[k].extend(v)
    span = (max(r.finish_s for r in done) - min(r.arrival_s for r in run.records)) if done else 0.0
    tokens = sum(r.output_tokens for r in done)
    st = count_stalls([r.token_times for r in done], k=STALL_K)
    inst = run.instances
    out = {"completed": len(done), "failed": sum(r.status == "failed" for r in run.records),
           "aborted": sum(r.status == "aborted" for r in run.records), "clipped": clipped,
           "errors": failure_reasons(run.records),
           **{k: stats(samples[k]) for k in LATENCIES},
           "throughput_rps": len(done) / span if span > 0 else 0.0,
           "output_tokens_per_s": tokens / span if span > 0 else 0.0,
           **_goodput(run, slo, span),
           "resource_usage_s": sum(i.busy_s for i in inst) if inst else None,
           "perf_per_dollar_vs_first": None,
           "stalls": {"count": st.count, "seconds": float(st.total_s), "longest_s": st.longest_s,
                      "threshold_s": st.threshold_s, "num_gaps": st.num_gaps},
           "padding_tokens": sum(i.pad_tokens for i in inst) if inst else None,
           "kv_bytes_moved": run.kv_bytes_moved, **_kv_summary(run.kv_transfer), "flips": run.flips,
           "failures": list(run.failures), "instance_failures": len(run.failures) if inst else None,
           "recovery_s_max": max((f["recovered_s"] for f in run.failures if f["recovered_s"] is not None),
                                 default=None),
           "flip_s_max": max((f["flip_s"] for f in run.flip_log), default=None),
           "drain_s_max": max((f["drain_s"] for f in run.flip_log), default=None),
           "flips_per_min": run.flips * 60 / span if run.flips is not None and span > 0 else None,
           "flip_log": [{k: f[k] for k in ("instance", "from", "to", "drain_s", "flip_s", "reason", "at", "migrated")
                         if k in f} for f in run.flip_log],
           "placements": run.placements, "moves": len(run.move_log) if run.placements is not None else None,
           "move_log": list(run.move_log),
           "predictor": run.predictor,
           "predictor_accuracy": (run.predictor or {}).get("accuracy"),
           **_prefix_cache(done), "prefix_cache_evictions": run.cache_evictions,
           "makespan_s": span, "output_tokens": tokens, "preemptions": sum(r.num_preemptions for r in done),
           "wall_s": run.wall_s,
           "simulated_s_per_wall_s": (span / run.wall_s if run.wall_s and _simulated(run) else None),
           "max_loop_lag_s": run.max_loop_lag_s, "config": run.config,
           "instances": [{"id": i.id, "role": i.role, "busy_s": i.busy_s, "prefill_tokens": i.prefill_tokens,
                          "decode_tokens": i.decode_tokens, "pad_tokens": i.pad_tokens,
                          "free_blocks_start": i.free_blocks_start, "free_blocks_end": i.free_blocks_end}
                         for i in inst]}
    out["perf"] = out["output_tokens_per_s"] / out["resource_usage_s"] if out["resource_usage_s"] else None
    out["predictor_label"] = predictor_label(out)
    for key, value in run.vllm.items():  # beside aserve's own; completed and failed mean the same in both
        out.setdefault(key, value)
    return out


def _prefix_cache(done: Sequence[RequestRecord]) -> dict:
    """Prompt tokens of the completed requests and the share their prefills found cached (vLLM's
    prefix cache hit rate, over this replay's requests alone); None where it is not known."""
    known = [r for r in done if r.cached_tokens is not None]
    if not known:
        return {"prefix_cache_hit_rate": None, "prefix_cache_hit_tokens": None}
    hits, queried = sum(r.cached_tokens for r in known), sum(r.prompt_tokens for r in known)
    return {"prefix_cache_hit_rate": hits / queried if queried else None, "prefix_cache_hit_tokens": hits}


def _goodput(run: SystemRun, slo: Optional[Slo], span: float) -> dict:
    """Attainment, request_goodput (good requests / the run's span, as vLLM divides by its
    benchmark's duration) and per device; None where no SLO was given (or devices are unknown)."""
    devices = run.num_devices
    if slo is None:
        return {"slo_attainment": None, "slo_good": None, "request_goodput": None, "goodput_per_device": None,
                "slo_misses": None, "devices": devices}
    a = attainment(run.records, slo)
    goodput = a["good"] / span if span > 0 else 0.0
    return {"slo_attainment": a["slo_attainment"], "slo_good": a["good"], "request_goodput": goodput,
            "goodput_per_device": goodput / devices if devices else None, "slo_misses": a["misses"],
            "devices": devices}


def failure_reasons(records) -> dict:
    """Why requests failed: each distinct error message and how many failed with it, commonest first."""
    counts = Counter(r.error or "no reason recorded" for r in records if r.status == "failed")
    return dict(counts.most_common())


def _simulated(run: SystemRun) -> bool:
    return str(run.config.get("engine", {}).get("device", "")).startswith("sim:")


def _kv_summary(kv: Optional[dict]) -> dict:
    """Real and emulated transfer time of the hand-overs, the bytes the link was charged (a
    simulated device's hand-overs copy nothing but are charged their KV's size: the KV bytes that
    moved between instances, on any device), and the real copy's throughput. An in-process run
    that handed nothing over (a coupled system) moved 0 bytes; over HTTP nothing is known."""
    if not kv or not kv.get("num_done"):
        return {"kv_transfers": (kv or {}).get("num_done"), "kv_bytes_charged": None if kv is None else 0,
                "kv_real_s": None, "kv_emulated_s": None, "kv_real_bytes_per_s": None}
    real = kv["real_copy_s"]
    out = {"kv_transfers": int(kv["num_done"]), "kv_bytes_charged": int(kv.get("emulated_bytes", 0)),
           "kv_real_s": real, "kv_emulated_s": kv["emulated_s"],
           "kv_real_bytes_per_s": kv["bytes"] / real if real > 0 else None}
    if "sent_direct" in kv:  # Ray: how the hand-overs went between the actors
        out["kv_via"] = {"direct": int(kv["sent_direct"]), "shared-memory": int(kv.get("sent_shared_memory", 0)),
                         "object-store": int(kv.get("sent_object_store", 0))}
    return out


def build_report(trace_summary: dict, runs: Sequence[SystemRun], slo: Optional[Slo] = None,
                 clipped: int = 0, requests: Sequence = ()) -> dict:
    """``{"trace": {...}, "systems": {name: {...}}}``; perf/$ relative to the first system."""
    systems = {run.name: summarize(run, slo, clipped) for run in runs}
    first = next(iter(systems.values()), None)
    for s in systems.values():
        if first and first["perf"] and s["perf"] is not None:
            s["perf_per_dollar_vs_first"] = s["perf"] / first["perf"]
    add_oracle_gain_kept(systems)
    trace = dict(trace_summary)
    if slo is not None:  # ``requests``: the trace's (fitted lengths), for the limits each works out to
        reqs = requests or (runs[0].records if runs else ())
        trace["slo"] = slo.to_json(reqs)
        trace["slo_line"] = slo.describe(reqs)
        share = slo.meetable_share(reqs)
        trace["slo"]["meetable_alone"] = share
        if share < ATTAINMENT_TARGET:
            trace["slo_line"] += (f"\n  only {share:.0%} of these requests could meet it even alone on the device "
                                  f"(attainment {ATTAINMENT_TARGET:.0%} is out of reach at any rate)")
    trace["perf_per_dollar"] = "output tokens/s divided by resource usage s (sum of instances' busy s), vs the first"
    return {"trace": trace, "systems": systems}


GAIN_KEYS = ("normalized_latency", "jct")


def add_oracle_gain_kept(systems: dict) -> None:
    """Where one system runs ``--predictor none`` and one ``--predictor oracle``, each system with a
    predictor gets ``oracle_gain_kept``: per mean latency in ``GAIN_KEYS``, the share of the
    oracle's improvement over ``none`` that it keeps, ``(none - it) / (none - oracle)``: 1 is as
    good as knowing every length, 0 no better than not predicting, below 0 worse. None where the
    oracle gained nothing to share."""
    def predictor(s: dict) -> Optional[str]:
        return (s.get("predictor") or {}).get("name")

    by_predictor = {predictor(s): s for s in systems.values()}
    base, oracle = by_predictor.get("none"), by_predictor.get("oracle")
    if base is None or oracle is None:
        return
    for s in systems.values():
        if predictor(s) in (None, "none"):
            continue
        kept = {}
        for key in GAIN_KEYS:
            if not (base[key] and oracle[key] and s[key]):
                continue
            gain = base[key]["mean"] - oracle[key]["mean"]
            kept[key] = (base[key]["mean"] - s[key]["mean"]) / gain if gain > 0 else None
        s["oracle_gain_kept"] = kept


def write_json(report: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return path


# ---- the rich table ------------------------------------------------------------------------------
_LAT_ROWS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("token gap", "token_gap"), ("JCT", "jct"),
             ("norm. latency", "normalized_latency"), ("queue time", "queue_time"))
_SCALAR_ROWS = (("throughput req/s", "throughput_rps", "{:.3f}"), ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
                ("resource usage s", "resource_usage_s", "{:.2f}"),
                ("perf/$ vs first", "perf_per_dollar_vs_first", "{:.2f}"), ("padding tokens", "padding_tokens", "{:d}"),
                ("KV bytes moved", "kv_bytes_moved", "{:,d}"),
                ("KV bytes on the link", "kv_bytes_charged", "{:,d}"),
                ("KV transfer s, real (sum)", "kv_real_s", "{:.3f}"),
                ("KV transfer s, emulated (sum)", "kv_emulated_s", "{:.3f}"),
                ("KV real copy bytes/s", "kv_real_bytes_per_s", "{:,.0f}"), ("flips", "flips", "{:d}"),
                ("decodes moved by KV (rebalance, relief)", "moves", "{:d}"),
                ("flips per minute", "flips_per_min", "{:.2f}"), ("flip s (max, no drain)", "flip_s_max", "{:.4f}"),
                ("drain s (max)", "drain_s_max", "{:.2f}"),
                ("predictor accuracy (online)", "predictor_accuracy", "{:.1%}"),
                ("instance failures", "instance_failures", "{:d}"),
                ("recovery s (max)", "recovery_s_max", "{:.3f}"),
                ("prefix cache hit rate", "prefix_cache_hit_rate", "{:.1%}"),
                ("prefix cache evictions (blocks)", "prefix_cache_evictions", "{:,d}"),
                ("preemptions", "preemptions", "{:d}"), ("makespan s", "makespan_s", "{:.2f}"),
                ("simulated s per wall s", "simulated_s_per_wall_s", "{:.1f}"))


def _ratio(value, base) -> str:
    return f" [dim](x{value / base:.2f})[/dim]" if base and value is not None else ""


def _latency_cell(s: dict, first: dict, key: str, is_first: bool) -> str:
    v = s[key]
    if v is None:
        return "n/a"
    if key == "token_gap":  # the tail is the point: a rare long stall must not hide
        cell = f"{v['p50']:.3f} {v['p99']:.3f} {v['p999']:.3f} {v['max']:.3f}"
        return cell if is_first or not first[key] else cell + _ratio(v["p99"], first[key]["p99"])
    cell = f"{v['mean']:.3f} {v['p50']:.3f} {v['p90']:.3f} {v['p99']:.3f}"
    return cell if is_first or not first[key] else cell + _ratio(v["mean"], first[key]["mean"])


def _predictions_cell(p: Optional[dict]) -> str:
    if not p or "predictions" not in p:  # over HTTP only the server's backend is known
        return "n/a"
    reasons = ", ".join(f"{n} {r}" for r, n in p.get("fallback_reasons", {}).items() if n)
    p50, tapped = p.get("latency_p50_s"), p.get("from_prefill")
    return (f"{p['predictions']} / {p['fallbacks']}" + (f" ({reasons})" if reasons else "") +
            (f", {tapped} from the prefill" if tapped else "") +
            (f", p50 {p50 * 1e3:.0f} ms" if p50 is not None else ""))


def _gain_cell(s: dict) -> str:
    kept = s.get("oracle_gain_kept")
    if kept is None:
        return "n/a"
    return " / ".join("n/a" if kept.get(k) is None else f"{kept[k]:.0%}" for k in GAIN_KEYS)


def predictor_label(s: dict) -> str:
    """The length predictor a system ran with, as the table's header names it: the backend, and
    the set accuracy of a simulation's ``accuracy`` predictor."""
    p = s.get("predictor") or {}
    name = p.get("name")
    if not name:
        return "predictor n/a"
    options = dict((s.get("config") or {}).get("cluster", {}).get("predictor_options") or ())
    if name == "accuracy":
        return f"accuracy {float(options.get('accuracy', 0.749)):.1%}"
    return name


def _slo_rows(systems: dict, first: dict) -> list[list[str]]:
    """Attainment, goodput and per device, and which limits the bad requests missed."""
    values = list(systems.values())
    if all(s.get("slo_attainment") is None for s in values):
        return []

    def attained(s):
        a = s["slo_attainment"]
        return "n/a" if a is None else f"{a:.1%} ({s['slo_good']} good)"

    def per_device(s):
        g = s["goodput_per_device"]
        return "n/a (devices unknown: --devices)" if g is None else f"{g:.3f} ({s['devices']} devices)"

    def missed(s):
        return " / ".join(f"{k} {n}" for k, n in (s.get("slo_misses") or {}).items()) or "none"

    return [["SLO attainment"] + [attained(s) for s in values],
            ["request goodput req/s"] + [f"{s['request_goodput']:.3f}" + ("" if i == 0 else
                                         _ratio(s["request_goodput"], first["request_goodput"]))
                                         for i, s in enumerate(values)],
            ["goodput per device req/s"] + [per_device(s) for s in values],
            ["requests missing each SLO"] + [missed(s) for s in values]]


def _rows(systems: dict) -> list[list[str]]:
    names = list(systems)
    first = systems[names[0]]
    rows = [["requests ok/fail/abort/clip"] +
            [f"{s['completed']}/{s['failed']}/{s['aborted']}/{s['clipped']}" for s in systems.values()]]
    rows += _slo_rows(systems, first)  # the headline, where an SLO was given
    for label, key in _LAT_ROWS:
        rows.append([f"{label} s"] +
                    [_latency_cell(s, first, key, i == 0) for i, s in enumerate(systems.values())])
    st = [s["stalls"] for s in systems.values()]
    rows.append(["stalls (count / s / longest)"] +
                [f"{x['count']} / {x['seconds']:.2f} s / {x['longest_s']:.2f} s" for x in st])
    if any(s.get("kv_via") for s in systems.values()):  # Ray: how the hand-overs went between actors
        rows.append(["KV hand-overs direct (shared memory) / object store"] +
                    [f"{s['kv_via']['direct']} ({s['kv_via'].get('shared-memory', 0)}) / "
                     f"{s['kv_via']['object-store']}" if s.get("kv_via") else "n/a" for s in systems.values()])
    if any(s.get("predictor") for s in systems.values()):  # a backend that timed out shows here, not only in JSON
        rows.append(["predictions / fallbacks"] + [_predictions_cell(s.get("predictor")) for s in systems.values()])
    if any("oracle_gain_kept" in s for s in systems.values()):
        rows.append(["oracle's gain kept (norm. latency / JCT)"] + [_gain_cell(s) for s in systems.values()])
    for label, key, fmt in _SCALAR_ROWS:
        cells = []
        for i, s in enumerate(systems.values()):
            v = s.get(key)  # a key an older report lacks: n/a
            text = "n/a" if v is None else fmt.format(v)
            cells.append(text if i == 0 or key == "perf_per_dollar_vs_first" else text + _ratio(v, first.get(key)))
        rows.append([label] + cells)
    return rows


def print_report(report: dict, console=None) -> None:
    """The trace summary (with every fitting change) and the systems side by side."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    import sys

    console = console or (Console() if sys.stdout.isatty() else Console(width=150))  # logs: no wrapped cells
    t = report["trace"]
    console.print(f"[bold]trace[/bold] {t.get('source', '')} ({t.get('format', '')}): {t.get('num_requests')} requests "
                  f"over {t.get('duration_s', 0):.1f} s, prompts: {t.get('prompts', 'n/a')}, target: {t.get('target', 'n/a')}")
    for change in t.get("changes", []):
        console.print(f"  fitted: {change}")
    if t.get("slo_line"):
        console.print(escape(t["slo_line"]), highlight=False)
    systems = report["systems"]
    if not systems:
        return
    table = Table(title="replay: latencies as mean p50 p90 p99, token gaps as p50 p99 p99.9 max; "
                        "(xN) = ratio to the first system (of the mean; of p99 for token gaps)", show_lines=False)
    table.add_column("metric", style="bold")
    for name, s in systems.items():  # each system's predictor in its header: a table never hides an oracle
        table.add_column(f"{escape(name)}\n[dim]{escape(s.get('predictor_label') or predictor_label(s))}[/dim]",
                         justify="right")
    for row in _rows(systems):
        table.add_row(*row)
    console.print(table)
    for name, s in systems.items():  # a failed request is counted in the table; here is why it failed
        for message, n in (s.get("errors") or {}).items():
            console.print(f"[red]{escape(name)}: {n} failed[/red]: {escape(message)}", highlight=False)
    console.print(f"[dim]TPOT = a request's mean time per output token; token gap = time between two tokens of a "
                  f"request; stall = a token gap > {STALL_K:g}x the median gap; resource usage = sum of instances' busy "
                  "seconds; perf/$ = (output tokens/s) / resource usage, relative to the first system[/dim]")
