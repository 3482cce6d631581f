"""``aserve monitor`` and ``aserve serve --tui``: a live terminal dashboard of a running server.

    aserve monitor --url http://127.0.0.1:8000 [--interval 1] [--api-key KEY] [--once | --json] [--compact]

It only reads snapshots: ``GET /v1/stats`` (every instance and link) and ``GET /metrics``
(latency histograms). ``serve --tui`` draws the same frame in the server's own process from
the in-process snapshot, on the event-loop thread (the thread rule), once per interval.

    source.take() ──Sample──► Dashboard (History: rates, windowed quantiles, events) ──► rich Live

A server that goes away does not stop the monitor: the last frame stays, marked "connection
lost", and it keeps asking; when the server is back it goes on (a restarted server, whose
uptime went back, starts the rates and windows over). Ctrl-C ends it with exit code 0.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, NoReturn, Optional, TypeVar

from rich.console import Console, RenderableType
from rich.live import Live

from aserve.monitor.data import Sample, sample_from
from aserve.monitor.history import History
from aserve.monitor.view import render
from aserve.replay.urls import api_base

ONCE_TRIES = 3  # --once / --json: attempts before "connection lost"
COMPACT_BELOW = 30  # terminals with fewer lines get the compact frame
WINDOW_S = 30.0
T = TypeVar("T")


class FetchError(Exception):
    """The server could not be read this time (refused, timed out, bad answer): retry later."""


class BadAnswer(FetchError):
    """The server answered, but not with a snapshot (401, 404, not JSON): asking again will not
    help until someone fixes the key or the URL. ``--once`` stops at once; the live view keeps
    asking, as it does for a server that went away."""


def parse_url(url: str) -> str:
    """``http://host:port[/v1]`` -> ``http://host:port``; ValueError names what is wrong."""
    base = api_base(url)
    parts = urllib.parse.urlsplit(base)
    try:
        parts.port  # noqa: B018 - raises on a port out of range or not a number
    except ValueError:
        raise ValueError(f"bad --url {url!r}: the port must be a number in [0, 65535]") from None
    if not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"bad --url {url!r}: expected http://HOST:PORT")
    return f"{parts.scheme}://{parts.netloc}"


class HttpSource:
    """Snapshots of a server over HTTP. Environment proxies are ignored, as the replay client's
    aiohttp session ignores them: the monitor talks to the server itself."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout_s: float = 5.0):
        self.base_url, self.timeout_s = base_url, timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get(self, path: str) -> bytes:
        req = urllib.request.Request(self.base_url + path, headers=self.headers)
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise BadAnswer("HTTP 401: pass the server's key with --api-key") from None
            if e.code < 500:
                raise BadAnswer(f"HTTP {e.code} on {path}: is this an aserve server?") from None
            raise FetchError(f"HTTP {e.code} on {path}") from None
        except urllib.error.URLError as e:
            raise FetchError(str(e.reason)) from None
        except (OSError, http.client.HTTPException) as e:  # timeouts, resets mid-answer
            raise FetchError(str(e) or type(e).__name__) from None

    def stats(self) -> dict:
        try:
            stats = json.loads(self.get("/v1/stats"))
        except ValueError as e:
            raise BadAnswer(f"/v1/stats is not JSON: {e}") from None
        instances = stats.get("instances") if isinstance(stats, dict) else None
        if not isinstance(instances, list) or not all(isinstance(i, dict) and "id" in i for i in instances):
            raise BadAnswer("/v1/stats has no list of instances with ids: is this an aserve server?")
        return stats

    def take(self) -> Sample:
        stats = self.stats()
        try:
            return sample_from(stats, self.get("/metrics").decode(), time.time())
        except ValueError as e:  # not Prometheus text (or not UTF-8)
            raise BadAnswer(f"/metrics does not parse: {e}") from None


class Dashboard:
    """What the monitor remembers between frames: the history and the connection status."""

    def __init__(self, source_name: str, window_s: float = WINDOW_S, compact: Optional[bool] = None):
        self.source_name, self.compact = source_name, compact
        self.history = History(window_s=window_s)
        self.status: Optional[str] = None

    def feed(self, sample: Sample) -> None:
        self.history.add(sample)
        self.status = None

    def lost(self, error: FetchError, interval_s: float) -> None:
        if isinstance(error, BadAnswer):
            self.status = f"{self.source_name}: {error}"
        else:
            self.status = f"connection lost: {self.source_name} ({error}); retrying every {interval_s:g}s"

    def frame(self, console: Console) -> RenderableType:
        height = console.size.height
        compact = self.compact if self.compact is not None else console.is_terminal and height < COMPACT_BELOW
        view = self.history.view() if self.history.samples else None
        return render(view, self.source_name, self.status, compact=compact, width=console.size.width,
                      height=height)


# ---- drivers ---------------------------------------------------------------------------------------
def take_with_retries(take: Callable[[], T], tries: int, delay_s: float) -> T:
    """``take()``, asked up to ``tries`` times ``delay_s`` apart; a bad answer is final at once."""
    for _ in range(tries - 1):
        try:
            return take()
        except BadAnswer:
            raise
        except FetchError:
            time.sleep(delay_s)
    return take()


def run_once(source: HttpSource, console: Console, interval_s: float, compact: Optional[bool]) -> int:
    """Two snapshots ``interval_s`` apart (so rates are real), one frame, done."""
    board = Dashboard(source.base_url, compact=compact)
    try:
        board.feed(take_with_retries(source.take, ONCE_TRIES, interval_s))
        time.sleep(interval_s)
        board.feed(take_with_retries(source.take, ONCE_TRIES, interval_s))
    except FetchError as e:
        return _gave_up(console, source.base_url, e)
    console.print(board.frame(console))
    return 0


def run_json(source: HttpSource, console: Console, interval_s: float) -> int:
    """One /v1/stats snapshot as JSON on stdout, for scripts."""
    try:
        stats = take_with_retries(source.stats, ONCE_TRIES, interval_s)
    except FetchError as e:
        return _gave_up(console, source.base_url, e)
    print(json.dumps(stats, indent=1))
    return 0


def _gave_up(console: Console, url: str, e: FetchError) -> int:
    """``--once``/``--json`` without a snapshot. No server is not an error for a script that
    polls (exit 0); a server that answers something else is (exit 1, on stderr)."""
    if isinstance(e, BadAnswer):
        Console(stderr=True).print(f"aserve: error: {url}: {e}", style="red", highlight=False, soft_wrap=True)
        return 1
    console.print(f"connection lost: {url} ({e}); gave up after {ONCE_TRIES} tries", style="red", highlight=False,
                  soft_wrap=True)
    return 0


def run_live(source: HttpSource, console: Console, interval_s: float, compact: Optional[bool]) -> NoReturn:
    """Redraw every ``interval_s`` until Ctrl-C; the caller turns KeyboardInterrupt into exit 0.
    SIGTERM ends it the same way, so rich gives the terminal back (the alternate screen) either way.
    Both handlers are installed and both signals unblocked here, not inherited: a monitor started
    by a process that ignores or blocks SIGINT would otherwise never see Ctrl-C (inside the full
    test suite the SIGINT case hung until this)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    board = Dashboard(source.base_url, compact=compact)
    with Live(console=console, auto_refresh=False, screen=console.is_terminal, redirect_stderr=False) as live:
        while True:
            t0 = time.monotonic()
            try:
                board.feed(source.take())
            except FetchError as e:
                board.lost(e, interval_s)
            live.update(board.frame(console), refresh=True)
            time.sleep(max(0.0, interval_s - (time.monotonic() - t0)))


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


async def run_in_process(take: Callable[[], Sample], name: str, interval_s: float = 1.0,
                         console: Optional[Console] = None) -> None:
    """``serve --tui``: redraw from ``take`` (the server's own snapshot) until cancelled."""
    console = console or Console()
    board = Dashboard(name)
    with Live(console=console, auto_refresh=False, screen=console.is_terminal) as live:
        while True:
            board.feed(take())
            live.update(board.frame(console), refresh=True)
            await asyncio.sleep(interval_s)


def server_sampler(ctx) -> Callable[[], Sample]:
    """The in-process twin of ``HttpSource.take``: the same JSON and metrics text, no socket."""
    return lambda: sample_from(ctx.snapshot(), ctx.metrics.render().decode(), time.time())
