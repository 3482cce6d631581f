"""Print the peer table from guidellm's JSON reports: ``peer_table.py OUT_DIR SERVER...``.

Each ``OUT_DIR/<server>-c<streams>.json`` is one guidellm run (benchmarks/peer_vllm.sh); a row per
server and concurrency: output tokens/s (guidellm's mean), TTFT and ITL median / p95 in ms,
and requests ok / errored.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def row(path: Path) -> dict:
    bench = json.loads(path.read_text())["benchmarks"][0]
    m = bench["metrics"]
    ok = lambda key: m[key]["successful"]  # noqa: E731
    totals = m["request_totals"]
    return {"streams": bench["config"]["strategy"]["streams"], "tok_s": ok("output_tokens_per_second")["mean"],
            "ttft": (ok("time_to_first_token_ms")["median"], ok("time_to_first_token_ms")["percentiles"]["p95"]),
            "itl": (ok("inter_token_latency_ms")["median"], ok("inter_token_latency_ms")["percentiles"]["p95"]),
            "ok": totals["successful"], "errored": totals["errored"]}


def main(out: str, servers: list[str]) -> None:
    print("| server | streams | output tok/s | TTFT median / p95 ms | ITL median / p95 ms | ok / errored |")
    print("|---|---:|---:|---:|---:|---:|")
    for server in servers:
        own = re.compile(rf"{re.escape(server)}-c(\d+)\.json")  # whole name: not aserve-disagg's for aserve
        runs = sorted((int(m[1]), p) for p in Path(out).iterdir() if (m := own.fullmatch(p.name)))
        for i, (_, path) in enumerate(runs):
            r = row(path)
            print(f"| {server if i == 0 else ''} | {r['streams']} | {r['tok_s']:.0f} | {r['ttft'][0]:.0f} / "
                  f"{r['ttft'][1]:.0f} | {r['itl'][0]:.1f} / {r['itl'][1]:.1f} | {r['ok']} / {r['errored']} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
