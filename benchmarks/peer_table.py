"""Print the peer table from guidellm's JSON reports: ``peer_table.py OUT_DIR SERVER...``.

Each ``<server>-c<streams>.json`` is one guidellm run (benchmarks/peer_vllm.sh), in OUT_DIR
itself (one round of one shape) or in OUT_DIR/runN/SHAPE/ (``RUNS`` rounds of ``SHAPES``). A
table per shape, a row per server and concurrency: output tokens/s (guidellm's mean), TTFT and
ITL median / p95 in ms, and requests ok / errored; over several rounds each figure is the
median of the rounds' (errored requests summed), and the tokens/s column adds the rounds' range.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

FIGURES = ("tok_s", "ttft_median", "ttft_p95", "itl_median", "itl_p95")


def row(path: Path) -> dict:
    bench = json.loads(path.read_text())["benchmarks"][0]
    m = bench["metrics"]
    ok = lambda key: m[key]["successful"]  # noqa: E731
    totals = m["request_totals"]
    return {"streams": bench["config"]["strategy"]["streams"], "tok_s": ok("output_tokens_per_second")["mean"],
            "ttft_median": ok("time_to_first_token_ms")["median"],
            "ttft_p95": ok("time_to_first_token_ms")["percentiles"]["p95"],
            "itl_median": ok("inter_token_latency_ms")["median"],
            "itl_p95": ok("inter_token_latency_ms")["percentiles"]["p95"],
            "ok": totals["successful"], "errored": totals["errored"]}


def rounds(out: Path) -> dict[str, list[Path]]:
    """Shape -> the folders of its rounds: OUT/runN/SHAPE/, or OUT itself as one round of one shape."""
    runs = sorted((p for p in out.glob("run*") if p.is_dir() and p.name[3:].isdigit()), key=lambda p: int(p.name[3:]))
    if not runs:
        return {"": [out]}
    shapes: dict[str, list[Path]] = {}
    for run in runs:
        for shape in sorted(p for p in run.iterdir() if p.is_dir()):
            shapes.setdefault(shape.name, []).append(shape)
    return shapes


def cells(dirs: list[Path], server: str) -> dict[int, dict]:
    """Streams -> the median of each figure over the rounds that have it, their tokens/s range, and
    the rounds' requests (ok: the median; errored: the sum)."""
    own = re.compile(rf"{re.escape(server)}-c(\d+)\.json")  # whole name: not aserve-disagg's for aserve
    seen: dict[int, list[dict]] = {}
    for d in dirs:
        for p in d.iterdir():
            if m := own.fullmatch(p.name):
                seen.setdefault(int(m[1]), []).append(row(p))
    out = {}
    for streams, rows in sorted(seen.items()):
        cell = {f: statistics.median(r[f] for r in rows) for f in FIGURES}
        cell.update(rounds=len(rows), lo=min(r["tok_s"] for r in rows), hi=max(r["tok_s"] for r in rows),
                    ok=statistics.median(r["ok"] for r in rows), errored=sum(r["errored"] for r in rows))
        out[streams] = cell
    return out


def main(out: str, servers: list[str]) -> None:
    for shape, dirs in rounds(Path(out)).items():
        if shape:
            print(f"\n{shape.replace('x', ' prompt x ')} output tokens, median of {len(dirs)} round(s)\n")
        print("| server | streams | output tok/s | TTFT median / p95 ms | ITL median / p95 ms | ok / errored |")
        print("|---|---:|---:|---:|---:|---:|")
        for server in servers:
            for i, (streams, c) in enumerate(cells(dirs, server).items()):
                spread = f" ({c['lo']:.0f}-{c['hi']:.0f})" if c["rounds"] > 1 else ""
                print(f"| {server if i == 0 else ''} | {streams} | {c['tok_s']:.0f}{spread} | {c['ttft_median']:.0f} / "
                      f"{c['ttft_p95']:.0f} | {c['itl_median']:.1f} / {c['itl_p95']:.1f} | {c['ok']:.0f} / "
                      f"{c['errored']} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
