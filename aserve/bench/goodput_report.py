"""``aserve bench goodput``'s results: the table, the JSON (small and self-describing: the command,
commit, date and machine travel with the numbers) and the attainment-vs-rate plot."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from aserve.bench.goodput import Knee

BOUNDS = {"within": "the knee lies in the bracket",
          "at_least": "still passing with the whole trace arriving within one median prefill: the trace is too "
                      "short (too little load) to find this system's knee; use more requests",
          "below": "fails even at the floor (every request arriving after the one before it would have finished "
                   "alone): this system cannot meet the SLO at any rate",
          "max_points": "stopped at --max-points before the bracket closed to --precision"}


def limited_by(knee: Knee) -> Optional[str]:
    """The limit most requests missed at the lowest failing rate above the knee."""
    failing = [p for p in knee.points if p.attainment < knee.target and (knee.rate is None or p.rate > knee.rate)]
    if not failing:
        return None
    misses = min(failing, key=lambda p: p.rate).misses
    return max(misses, key=misses.get) if any(misses.values()) else None


def system_json(spec, knee: Knee, devices: int, wall_s: float, estimate_s: Optional[float], label: str) -> dict:
    c, e = spec.cluster, spec.engine
    at_knee = next((p for p in knee.points if p.rate == knee.rate), None)
    return {"devices": devices, "predictor": label,
            "knee_rate": knee.rate, "knee_bracket": list(knee.bracket), "knee_error": knee.error,
            "goodput_per_device": knee.rate / devices if knee.rate is not None else None,
            "request_goodput_at_knee": at_knee.request_goodput if at_knee else None,
            "attainment_at_knee": at_knee.attainment if at_knee else None,
            "bound": knee.bound, "bound_means": BOUNDS[knee.bound], "monotone": knee.monotone,
            "limited_by": limited_by(knee), "num_points": len(knee.points),
            "points": [[p.rate, p.attainment] for p in knee.points],
            "points_detail": [{"rate": p.rate, "attainment": p.attainment, "good": p.good, "misses": p.misses,
                               "makespan_s": p.makespan_s, "wall_s": p.wall_s, "prefix_cache_hit_rate": p.hit_rate,
                               "prefix_cache_evictions": p.evictions, "kv_bytes_moved": p.kv_bytes_moved,
                               "ttft_mean_s": p.ttft_mean_s, "ttft_p99_s": p.ttft_p99_s, "draws": list(p.draws)}
                              for p in knee.points],
            "wall_s": wall_s, "estimated_wall_s": estimate_s,
            "config": {"mode": c.mode, "layout": f"{c.num_prefill}P+{c.num_decode}D" if c.split else f"{c.num_coupled}",
                       "batching": e.batching, "chunk_size": c.chunk_size, "token_budget": e.max_num_batched_tokens,
                       "tbt_slo": e.tbt_slo, "prefill_token_budget": c.prefill_token_budget,
                       "slo_placement": c.slo_placement, "slo_order": c.slo_order, "tpot_placement": c.tpot_slo is not None,
                       "predictor": c.predictor, "predictor_options": dict(c.predictor_options),
                       "prefix_caching": e.enable_prefix_caching, "prefix_aware_placement": c.prefix_aware_placement}}


def _knee_cell(s: dict) -> str:
    lo, hi = s["knee_bracket"]
    if s["bound"] == "below":
        return f"none (fails at {hi:.3g})"
    if s["bound"] == "at_least":
        return f">= {lo:.3g}"
    return f"{lo:.3g} (+{hi - lo:.2g})" if hi is not None else f"{lo:.3g}"


def print_table(report: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"goodput: highest rate with >= {report['search']['target']:.0%} of requests meeting every SLO "
                    "(knee (+ error bar: the lowest failing rate above it))")
    for col in ("system", "predictor", "devices", "knee req/s", "goodput / device", "vs first", "limited by",
                "points", "wall s"):
        t.add_column(col, justify="left" if col in ("system", "predictor", "limited by") else "right")
    systems = report["systems"]
    base = next(iter(systems.values()))["goodput_per_device"]
    for name, s in systems.items():
        g = s["goodput_per_device"]
        ratio = f"x{g / base:.2f}" if g is not None and base else "n/a"
        t.add_row(escape(name), escape(s["predictor"]), str(s["devices"]), _knee_cell(s),
                  "n/a" if g is None else f"{'>= ' if s['bound'] == 'at_least' else ''}{g:.4g}", ratio,
                  s["limited_by"] or "-", str(s["num_points"]), f"{s['wall_s']:.1f}")
    console.print(t)
    repeats = report["search"].get("repeats", 1)
    if repeats > 1:
        console.print(f"each point pooled over {repeats} replays of its rate (points: rates probed; each replay's own "
                      "attainment in the JSON's points_detail, draws)")
    for name, s in systems.items():
        if s["bound"] != "within":
            console.print(f"[yellow]{escape(name)}[/yellow]: {s['bound']}: {s['bound_means']}")
        if not s["monotone"]:
            console.print(f"[yellow]{escape(name)}[/yellow]: attainment is not monotone in the rate over its points "
                          "(a failing rate below a passing one): the knee is the bisection's, read the points")


def write_json(report: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    return path


def plot_attainment(report: dict, path) -> Path:
    """Attainment against rate per system (log rate), the target line, each knee with its error bar."""
    import matplotlib.pyplot as plt

    from aserve.replay.plots import save_figure  # matplotlib on Agg

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, s in report["systems"].items():
        pts = sorted(s["points"])
        line, = ax.plot([r for r, _ in pts], [100 * a for _, a in pts], marker="o", markersize=3,
                        label=f"{name}: {s['goodput_per_device']:.3g}/device" if s["goodput_per_device"] is not None
                        else f"{name}: none")
        lo, hi = s["knee_bracket"]
        if lo is not None:
            err = [[0], [(hi - lo) if hi is not None else 0]]
            ax.errorbar([lo], [100 * report["search"]["target"]], xerr=err, color=line.get_color(), capsize=4,
                        marker="|", markersize=12)
    ax.axhline(100 * report["search"]["target"], color="black", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set(xlabel="arrival rate (req/s)", ylabel="requests meeting every SLO (%)", ylim=(-2, 102),
           title=f"{Path(report['trace']['source']).name}, SLO {report['slo']['name']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower left")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, Path(path))
