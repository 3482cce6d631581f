"""Replay plots (matplotlib, Agg): latency CDFs, instance timelines, changes vs the first system.

    cdf.png       TTFT, JCT and TBT CDFs, one line per system
    timeline.png  one panel per system, one lane per instance; shade = share of each sample
                  period its executor was busy, colour = its role then; a marker on a lane where a
                  decode moved by its KV landed there (adaptive: rebalance ▶, --kv-relief ▼)
    relative.png  like the paper's Figure 16: % change of mean TTFT, mean JCT, resource usage
                  and perf/$ of each system against the first (only with two or more systems)
    slo.png       under an SLO: each system's attainment (the 90% line drawn), its goodput per
                  device, and the share of requests missing each limit
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from aserve.replay.report import SystemRun, request_latencies  # noqa: E402

ROLE_COLOURS = {"prefill": "tab:blue", "decode": "tab:orange", "coupled": "tab:green"}
MOVE_MARKERS = {"rebalance": ">", "relief": "v"}  # where a decode moved by its KV landed, by why


def _samples(run: SystemRun, key: str) -> np.ndarray:
    vals = [v for r in run.records if r.status == "completed" and r.first_token_s is not None
            for v in request_latencies(r)[key]]
    return np.sort(np.asarray(vals, dtype=float))


def plot_cdfs(runs: Sequence[SystemRun], path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, label) in zip(axes, (("ttft", "TTFT"), ("jct", "JCT"), ("token_gap", "token gap"))):
        for run in runs:
            x = _samples(run, key)
            if len(x):
                ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=run.name, drawstyle="steps-post")
        positive = [v for run in runs for v in _samples(run, key) if v > 0]
        if positive and max(positive) / min(positive) > 100:
            ax.set_xscale("log")
        ax.set(xlabel=f"{label} (s)", ylabel="fraction of " + ("gaps" if key == "token_gap" else "requests"),
               title=f"{label} CDF", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    return save_figure(fig, path)


def busy_shares(samples: Sequence[tuple]) -> list[tuple[float, float, float, str]]:
    """(start, length, busy share, role) per sample period.

    ``busy_s`` grows when a step *ends*, so a step longer than the period lands in one sample;
    the excess is moved back into the periods before it, when that step was running.
    """
    spans = [(t0, t1 - t0, b1 - b0, role) for (t0, b0, _), (t1, b1, role) in zip(samples, samples[1:]) if t1 > t0]
    busy = [max(0.0, b) for _, _, b, _ in spans]
    for i in range(len(spans) - 1, 0, -1):
        excess = busy[i] - spans[i][1]
        if excess > 0:
            busy[i], busy[i - 1] = spans[i][1], busy[i - 1] + excess
    return [(t, dt, min(1.0, b / dt), role) for (t, dt, _, role), b in zip(spans, busy)]


def _lane(ax, y: int, samples: Sequence[tuple]) -> None:
    """One instance: a rectangle per sample period, alpha = busy share, colour = role."""
    for t, dt, share, role in busy_shares(samples):
        ax.broken_barh([(t, dt)], (y - 0.4, 0.8), color=ROLE_COLOURS.get(role, "grey"),
                       alpha=0.1 + 0.9 * share, linewidth=0)


def plot_timelines(runs: Sequence[SystemRun], path: Path) -> Path:
    runs = [r for r in runs if r.instances]
    fig, axes = plt.subplots(max(1, len(runs)), 1, figsize=(12, 1.2 + 1.1 * sum(max(1, len(r.instances)) for r in runs)),
                             squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        lanes = {}
        for y, inst in enumerate(run.instances):
            _lane(ax, y, inst.samples)
            lanes[inst.id] = y
        for why, marker in MOVE_MARKERS.items():
            moves = [(m["at"], lanes[m["to"]]) for m in run.move_log if m["why"] == why and m["to"] in lanes]
            if moves:
                ax.scatter(*zip(*moves), marker=marker, s=40, color="black", edgecolors="white", linewidths=0.6,
                           zorder=3)
        ax.set_yticks(range(len(run.instances)),
                      [f"{i.id} ({i.role}) {i.busy_s:.1f}s busy" for i in run.instances], fontsize=8)
        ax.set_ylim(-0.6, len(run.instances) - 0.4)
        ax.set_title(f"{run.name}: instance busy share per {_period(run):.2g} s (darker = busier)", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time since the replay started (s)")
    handles = [Patch(color=c, label=role) for role, c in ROLE_COLOURS.items()]
    whys = {m["why"] for r in runs for m in r.move_log}
    handles += [Line2D([], [], marker=m, linestyle="", color="black", label=f"a decode moved in ({why})")
                for why, m in MOVE_MARKERS.items() if why in whys]
    # below the last panel: above the first it covered the title
    axes[-1, 0].legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=len(handles),
                       fontsize=8, frameon=False)
    return save_figure(fig, path)


def _period(run: SystemRun) -> float:
    s = run.instances[0].samples if run.instances else ()
    return (s[1][0] - s[0][0]) if len(s) > 1 else 0.0


def relative_changes(report: dict) -> dict[str, dict[str, float]]:
    """% change vs the first system of mean TTFT, mean JCT, resource usage and perf/$."""
    systems = list(report["systems"].items())
    first = systems[0][1]
    out = {}
    for name, s in systems[1:]:
        row = {}
        for label, get in (("TTFT", lambda x: x["ttft"] and x["ttft"]["mean"]),
                           ("JCT", lambda x: x["jct"] and x["jct"]["mean"]),
                           ("resource usage", lambda x: x["resource_usage_s"])):
            a, b = get(first), get(s)
            row[label] = 100.0 * (b / a - 1.0) if a and b is not None else float("nan")
        ppd = s["perf_per_dollar_vs_first"]
        row["perf/$"] = 100.0 * (ppd - 1.0) if ppd is not None else float("nan")
        out[name] = row
    return out


def plot_relative(report: dict, path: Path) -> Path:
    changes = relative_changes(report)
    labels = ["TTFT", "JCT", "resource usage", "perf/$"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(changes))
    x = np.arange(len(labels))
    for k, (name, row) in enumerate(changes.items()):
        vals = [row[label] for label in labels]
        bars = ax.bar(x + (k - (len(changes) - 1) / 2) * width, vals, width, label=name)
        ax.bar_label(bars, labels=[f"{v:+.0f}%" if np.isfinite(v) else "n/a" for v in vals], fontsize=8)
    first = next(iter(report["systems"]))
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(x, ["mean TTFT\n(lower is better)", "mean JCT\n(lower is better)",
                      "resource usage\n(lower is better)", "perf/$\n(higher is better)"])
    ax.set_ylabel(f"change vs {first} (%)")
    ax.set_title(f"Relative to {first} (cf. TetriInfer Fig. 16)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def plot_slo(report: dict, path: Path) -> Path:
    systems = report["systems"]
    names = list(systems)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = np.arange(len(names))
    attained = [100 * (systems[n]["slo_attainment"] or 0) for n in names]
    bars = axes[0].bar(x, attained, color="tab:green")
    axes[0].bar_label(bars, labels=[f"{v:.0f}%" for v in attained], fontsize=8)
    axes[0].axhline(90, color="black", linestyle="--", linewidth=0.8)
    axes[0].set(ylabel="requests meeting every SLO (%)", title="SLO attainment", ylim=(0, 105))
    per_device = [systems[n]["goodput_per_device"] or 0.0 for n in names]
    bars = axes[1].bar(x, per_device, color="tab:blue")
    axes[1].bar_label(bars, labels=[f"{v:.3g}" for v in per_device], fontsize=8)
    axes[1].set(ylabel="good requests / s / device", title="goodput per device (at this run's rate)")
    keys = sorted({k for n in names for k in (systems[n]["slo_misses"] or {})})
    width = 0.8 / max(1, len(keys))
    for k, key in enumerate(keys):
        share = [100 * (systems[n]["slo_misses"] or {}).get(key, 0) / max(1, systems[n]["completed"] + systems[n]["failed"]
                                                                           + systems[n]["aborted"]) for n in names]
        axes[2].bar(x + (k - (len(keys) - 1) / 2) * width, share, width, label=key)
    axes[2].set(ylabel="requests missing it (%)", title="which limit the bad requests missed")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(x, names, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(report["trace"].get("slo_line", "").split("\n")[0], fontsize=8)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(runs: Sequence[SystemRun], report: dict, out_dir) -> list[Path]:
    """Every plot that applies; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_cdfs(runs, out / "cdf.png")]
    if any(r.instances for r in runs):
        paths.append(plot_timelines(runs, out / "timeline.png"))
    if len(report["systems"]) > 1:
        paths.append(plot_relative(report, out / "relative.png"))
    if any(s.get("slo_attainment") is not None for s in report["systems"].values()):
        paths.append(plot_slo(report, out / "slo.png"))
    return paths
