"""``aserve monitor``: the live terminal dashboard of a running server (docs/MONITOR.md)."""
from __future__ import annotations

import argparse
import os


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("monitor", help="live terminal dashboard of a running aserve server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between snapshots (default 1)")
    p.add_argument("--api-key", default=None,
                   help="the server's key, sent as 'Authorization: Bearer KEY' (default: $ASERVE_API_KEY)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds one HTTP request may take")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--once", action="store_true", help="print one frame (two snapshots --interval apart), exit")
    out.add_argument("--json", action="store_true", help="print one /v1/stats snapshot as JSON, exit")
    p.add_argument("--compact", action="store_true", default=None,
                   help="the 80x24 frame (default: when the terminal has fewer than 30 lines)")
    p.set_defaults(func=cmd_monitor)
    return p


def cmd_monitor(a: argparse.Namespace) -> int:
    if not 0.05 <= a.interval <= 3600:
        raise ValueError(f"--interval must be in [0.05, 3600] seconds, got {a.interval:g}")
    if a.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {a.timeout:g}")
    # the environment is read here, in the CLI layer, as serve reads it
    key = a.api_key if a.api_key is not None else os.environ.get("ASERVE_API_KEY") or None
    from rich.console import Console

    from aserve.monitor.dashboard import HttpSource, parse_url, run_json, run_live, run_once

    source = HttpSource(parse_url(a.url), key, a.timeout)
    console = Console()
    try:
        if a.json:
            return run_json(source, console, a.interval)
        if a.once:
            return run_once(source, console, a.interval, a.compact)
        run_live(source, console, a.interval, a.compact)
    except KeyboardInterrupt:  # Ctrl-C is how a live monitor ends: not an error
        return 0
