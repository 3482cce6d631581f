"""``aserve serve``: the OpenAI-compatible HTTP server in the cluster's own process and loop.

    aserve serve [--mode disagg --prefill P --decode D | --mode coupled --instances N --batching B]
                 [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine flags]

``build_app`` (aserve/api_app.py) makes the application over a started cluster; ``ApiServer``
binds it and drains it; ``run_server`` adds SIGINT/SIGTERM; ``cmd_serve`` loads the model,
starts the cluster and runs all of it under uvloop when installed.

Shutdown (a signal, or ``ApiServer.shutdown``): new requests get 503 and /health turns 503;
in-flight requests get ``shutdown_timeout_s`` to finish; the rest end with finish_reason
``abort`` (their clients still get a final chunk); then the listener closes.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Optional

from aiohttp import web

from aserve.api_app import CTX, ServeContext, ServerSettings, build_app

__all__ = ["ApiServer", "ServerSettings", "add_serve_parser", "build_app", "run_server"]
# After the last abort, how long handlers get to write their final chunk before the listener closes.
FINAL_WRITE_S = 2.0


class ApiServer:
    """One bound server over a started cluster: ``port = await start()``, then ``await shutdown()``."""

    def __init__(self, cluster, served_name: str, settings: ServerSettings = ServerSettings(),
                 aliases: tuple[str, ...] = ()):
        self.cluster, self.settings = cluster, settings
        self.app = build_app(cluster, served_name, settings, aliases)
        self.runner: Optional[web.AppRunner] = None

    @property
    def ctx(self) -> ServeContext:
        return self.app[CTX]

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Bind and serve; returns the bound port (pass 0 for a free one)."""
        # handler_cancellation: a client that goes away cancels its handler, whose finally aborts
        # the request; without it a non-streaming request would run to its end for nobody.
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=FINAL_WRITE_S)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        return self.runner.addresses[0][1]

    async def shutdown(self, timeout_s: Optional[float] = None) -> None:
        """Drain: refuse new work, wait for in-flight requests, abort the rest, close."""
        ctx, loop = self.ctx, asyncio.get_running_loop()
        ctx.draining = True
        timeout_s = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        deadline = loop.time() + timeout_s
        while self.cluster.requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.cluster.requests):
            self.cluster.abort(rid)
        deadline = loop.time() + FINAL_WRITE_S
        while ctx.num_active and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.runner is not None:
            await self.runner.cleanup()


async def run_server(cluster, served_name: str, settings: ServerSettings = ServerSettings(),
                     host: str = "127.0.0.1", port: int = 8000, aliases: tuple[str, ...] = (),
                     stop: Optional[asyncio.Event] = None, handle_signals: bool = True, tui: bool = False) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set), then drain and return. ``tui`` draws the
    live monitor (aserve/monitor.py) from the in-process snapshot until the drain starts."""
    server = ApiServer(cluster, served_name, settings, aliases)
    bound = await server.start(host, port)
    print(f"aserve: serving {served_name} ({cluster.cfg.mode}, {len(cluster.instances)} instances) "
          f"on http://{host}:{bound}", file=sys.stderr, flush=True)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    monitor = _start_tui(server, f"http://{host}:{bound}") if tui else None
    try:
        await stop.wait()
        await _stop_tui(monitor)
        monitor = None
        print(f"aserve: draining (up to {settings.shutdown_timeout_s:g} s)", file=sys.stderr, flush=True)
        await server.shutdown()
    finally:
        await _stop_tui(monitor)
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


# ---- serve --tui ----------------------------------------------------------------------------------
def _start_tui(server: ApiServer, name: str) -> asyncio.Task:
    from aserve.monitor import run_in_process, server_sampler

    return asyncio.create_task(run_in_process(server_sampler(server.ctx), name), name="aserve-tui")


async def _stop_tui(monitor: Optional[asyncio.Task]) -> None:
    """Cancel the monitor so rich gives the terminal back before the drain's messages."""
    if monitor is None:
        return
    monitor.cancel()
    await asyncio.wait([monitor])  # not ``await monitor``: that would swallow our own cancellation
    if not monitor.cancelled() and monitor.exception() is not None:
        print(f"aserve: the --tui monitor failed: {monitor.exception()!r}", file=sys.stderr, flush=True)


# ---- command line -------------------------------------------------------------------------------
def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``serve`` and its flags (the CLI's engine and cluster flags, plus the server's)."""
    from cli import add_cluster_args, add_engine_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, SSE, /metrics)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $ASERVE_API_KEY; /health stays open)")
    s.add_argument("--served-model-name", default=None, help="model name clients use (default: the folder name)")
    s.add_argument("--max-body-bytes", type=int, default=2**20, help="larger request bodies get 413 (default 1 MiB)")
    s.add_argument("--max-queued-requests", type=int, default=0,
                   help="429 once this many requests wait for their first token (0: no limit)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM (then: abort)")
    s.add_argument("--tui", action="store_true", help="draw the live monitor in this terminal (docs/MONITOR.md)")
    add_cluster_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def server_settings(a: argparse.Namespace) -> ServerSettings:
    # the environment is read here, in the CLI layer, and nowhere deeper
    key = a.api_key if a.api_key is not None else os.environ.get("ASERVE_API_KEY") or None
    return ServerSettings(api_key=key, max_body_bytes=a.max_body_bytes, max_queued_requests=a.max_queued_requests,
                          shutdown_timeout_s=a.shutdown_timeout)


def cmd_serve(a: argparse.Namespace) -> int:
    from cli import cluster_config, engine_config

    engine, cluster_cfg, settings = engine_config(a), cluster_config(a), server_settings(a)
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {a.port}")
    _run_loop(_serve(engine, cluster_cfg, settings, a.host, a.port, a.served_model_name, a.model, a.tui))
    return 0


async def _serve(engine, cluster_cfg, settings: ServerSettings, host: str, port: int,
                 served_name: Optional[str], model_arg: str, tui: bool = False) -> None:
    from aserve.cluster import Cluster

    print(f"aserve: loading {model_arg} ...", file=sys.stderr, flush=True)
    async with Cluster(engine, cluster_cfg) as cluster:
        name = served_name or cluster.bundle.path.name
        await run_server(cluster, name, settings, host, port, aliases=(model_arg,), tui=tui)


def _run_loop(coro) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)
