"""The OpenAI-compatible HTTP server in the cluster's own process and loop.

``build_app`` (aserve/api/app.py) makes the application over a started cluster; ``ApiServer``
binds it and drains it; ``run_server`` adds SIGINT/SIGTERM (``aserve serve``, in
aserve/commands/serve.py, loads the model, starts the cluster and runs it under uvloop).

Shutdown (a signal, or ``ApiServer.shutdown``): new requests get 503 and /health turns 503;
in-flight requests get ``shutdown_timeout_s`` to finish (a second signal cuts that short); the
rest end with finish_reason ``abort`` (their clients still get a final chunk, ``FINAL_WRITE_S``
at most); then the listener closes (``LISTENER_CLOSE_S`` at most). Every wait is bounded, so a
drain takes ``shutdown_timeout_s + FINAL_WRITE_S + LISTENER_CLOSE_S`` at most on any machine;
``aserve serve`` (aserve/commands/serve.py) bounds the rest of the exit.
"""
from __future__ import annotations

import asyncio
import signal
import sys
from typing import Callable, Optional

from aiohttp import web

from aserve.api.app import build_app
from aserve.api.context import CTX, ServeContext, ServerSettings

__all__ = ["ApiServer", "ServerSettings", "build_app", "run_server"]
# After the last abort, how long handlers get to write their final chunk before the listener closes.
FINAL_WRITE_S = 1.0
# Then how long aiohttp may wait for handlers still running before it closes their connections.
LISTENER_CLOSE_S = 0.5
DRAIN_POLL_S = 0.05


class ApiServer:
    """One bound server over a started cluster: ``port = await start()``, then ``await shutdown()``."""

    def __init__(self, cluster, served_name: str, settings: ServerSettings = ServerSettings(),
                 aliases: tuple[str, ...] = ()):
        self.cluster, self.settings = cluster, settings
        self.app = build_app(cluster, served_name, settings, aliases)
        self.runner: Optional[web.AppRunner] = None
        self._hurried = False

    @property
    def ctx(self) -> ServeContext:
        return self.app[CTX]

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Bind and serve; returns the bound port (pass 0 for a free one)."""
        # handler_cancellation: a client that goes away cancels its handler, whose finally aborts
        # the request; without it a non-streaming request would run to its end for nobody.
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=LISTENER_CLOSE_S)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        return self.runner.addresses[0][1]

    def hurry(self) -> None:
        """Cut a drain short: what is still in flight is aborted now (a second SIGINT/SIGTERM)."""
        self._hurried = True

    async def shutdown(self, timeout_s: Optional[float] = None) -> None:
        """Drain: refuse new work, wait for in-flight requests, abort the rest, close."""
        ctx, loop = self.ctx, asyncio.get_running_loop()
        ctx.draining = True
        timeout_s = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        deadline = loop.time() + timeout_s
        while self.cluster.requests and loop.time() < deadline and not self._hurried:
            await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - loop.time())))
        for rid in list(self.cluster.requests):
            self.cluster.abort(rid)
        deadline = loop.time() + FINAL_WRITE_S
        while ctx.num_active and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.runner is not None:
            await self.runner.cleanup()


async def run_server(cluster, served_name: str, settings: ServerSettings = ServerSettings(),
                     host: str = "127.0.0.1", port: int = 8000, aliases: tuple[str, ...] = (),
                     stop: Optional[asyncio.Event] = None, handle_signals: bool = True, tui: bool = False,
                     on_stop: Optional[Callable[[], None]] = None, notes: tuple[str, ...] = ()) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set), then drain and return; a second signal
    cuts the drain short. ``on_stop`` is called once, when the drain begins (``aserve serve``
    arms its exit deadline there). ``notes`` are printed once it listens (who may use it). ``tui``
    draws the live monitor (aserve/monitor/dashboard.py) from the in-process snapshot until the
    drain starts."""
    server = ApiServer(cluster, served_name, settings, aliases)
    bound = await server.start(host, port)
    print(f"aserve: serving {served_name} ({cluster.cfg.mode}, {len(cluster.instances)} instances) "
          f"on http://{host}:{bound}", file=sys.stderr, flush=True)
    for note in notes:
        print(f"aserve: {note}", file=sys.stderr, flush=True)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()

    def signalled() -> None:
        if stop.is_set():
            print("aserve: second signal: aborting what is still running", file=sys.stderr, flush=True)
            server.hurry()
        stop.set()

    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signalled)
    monitor = _start_tui(server, f"http://{host}:{bound}") if tui else None
    try:
        await stop.wait()
        if on_stop is not None:
            on_stop()
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
    from aserve.monitor.dashboard import run_in_process, server_sampler

    return asyncio.create_task(run_in_process(server_sampler(server.ctx), name), name="aserve-tui")


async def _stop_tui(monitor: Optional[asyncio.Task]) -> None:
    """Cancel the monitor so rich gives the terminal back before the drain's messages."""
    if monitor is None:
        return
    monitor.cancel()
    await asyncio.wait([monitor], timeout=1.0)  # not ``await monitor``: that would swallow our own cancellation
    if not monitor.done():
        return
    if not monitor.cancelled() and monitor.exception() is not None:
        print(f"aserve: the --tui monitor failed: {monitor.exception()!r}", file=sys.stderr, flush=True)
