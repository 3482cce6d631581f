"""The live monitor (aserve/monitor*.py): its maths by hand, its frame from recorded snapshots,
and ``aserve monitor`` against a real server, a dead one, and Ctrl-C."""
import asyncio
import copy
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from aserve.monitor.dashboard import Dashboard, FetchError, parse_url, run_in_process, server_sampler
from aserve.monitor.data import (TTFT, Histogram, Sample, histogram_delta, histogram_quantile, parse_histograms,
                                 rate, sample_from, sparkline)
from aserve.monitor.history import History
from aserve.monitor.view import render

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "monitor"
INF = float("inf")
WALL = 1_700_000_000.0


def _hist(*counts: float, bounds=(0.1, 0.5, 1.0, INF)) -> Histogram:
    return Histogram(tuple(zip(bounds, counts)))


# ---- histogram maths, by hand --------------------------------------------------------------------
def test_quantile_interpolates_inside_the_bucket():
    # cumulative (0.1: 0, 0.5: 4, 1.0: 8, +Inf: 8): four in (0.1, 0.5], four in (0.5, 1.0]
    h = _hist(0, 4, 8, 8)
    assert histogram_quantile(0.5, h) == pytest.approx(0.5)  # rank 4: the top of (0.1, 0.5]
    assert histogram_quantile(0.25, h) == pytest.approx(0.3)  # rank 2: 0.1 + 0.4 * 2/4
    assert histogram_quantile(0.99, h) == pytest.approx(0.99)  # rank 7.92: 0.5 + 0.5 * 3.92/4
    assert histogram_quantile(0.05, _hist(2, 2, 2, 2)) == pytest.approx(0.005)  # first bucket starts at 0


def test_quantile_in_the_open_bucket_and_of_nothing():
    assert histogram_quantile(0.5, _hist(0, 0, 1, 3)) == 1.0  # rank 1.5 lands in +Inf: the last finite bound
    assert histogram_quantile(0.5, _hist(0, 0, 0, 0)) is None
    with pytest.raises(AssertionError):
        histogram_quantile(0.0, _hist(1, 1, 1, 1))


def test_window_quantile_comes_from_bucket_deltas():
    old, new = _hist(1, 2, 2, 2), _hist(1, 6, 10, 10)  # the window saw 4 in (0.1, 0.5], 4 in (0.5, 1]
    delta = histogram_delta(old, new)
    assert delta.buckets == ((0.1, 0), (0.5, 4), (1.0, 8), (INF, 8))
    assert histogram_quantile(0.5, delta) == pytest.approx(0.5)
    # since the start (not the window) the p50 would be rank 5 of 10 in (0.1, 0.5]: 0.1 + 0.4 * 4/5
    assert histogram_quantile(0.5, new) == pytest.approx(0.42)
    assert histogram_delta(new, old) == old, "a count that went down is a restart: all of it is new"
    assert histogram_delta(None, new) == new


def _metrics(family: str, series: dict) -> str:
    lines = [f"# TYPE {family} histogram"]
    for instance, counts in series.items():
        for le, c in zip(("0.1", "0.5", "1.0", "+Inf"), counts):
            lines.append(f'{family}_bucket{{instance="{instance}",le="{le}"}} {c}')
        lines.append(f'{family}_count{{instance="{instance}"}} {counts[-1]}')
        lines.append(f'{family}_sum{{instance="{instance}"}} 1.0')
    return "\n".join(lines) + "\n"


def test_instances_are_summed_bucket_by_bucket_not_averaged():
    # p0: 9 fast requests (<= 0.1 s); c1: 1 slow one in (0.5, 1]. The p50 of all ten is fast.
    text = _metrics(TTFT, {"p0": (9, 9, 9, 9), "c1": (0, 0, 1, 1)})
    h = parse_histograms(text)[TTFT]
    assert h.buckets == ((0.1, 9), (0.5, 9), (1.0, 10), (INF, 10))
    assert histogram_quantile(0.5, h) == pytest.approx(0.1 * 5 / 9)  # rank 5 of 9 in [0, 0.1]
    # the average of the two p50s (0.0556 and 0.75) would say 0.40: wrong
    assert histogram_quantile(0.99, h) == pytest.approx(0.5 + 0.5 * 0.9)  # rank 9.9: 0.9 into (0.5, 1]


def test_rates_and_sparkline():
    assert rate(100, 300, 2.0) == 100.0
    assert rate(None, 300, 2.0) is None and rate(100, 300, 0.0) is None
    assert rate(300, 100, 2.0) is None, "a counter that went back is a restart, not a negative rate"
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7], 8) == "▁▂▃▄▅▆▇█"
    assert sparkline([0, 0, 0], 8) == "▁▁▁"
    assert sparkline([1.0] * 50, 10) == "█" * 10


# ---- the frame from a recorded snapshot ------------------------------------------------------------
def _recorded() -> list[Sample]:
    """Two /v1/stats + /metrics snapshots of a real disagg server (1 prefill, 1 decode) under
    load, 3.02 s apart."""
    return [sample_from(json.loads((DATA / f"stats_{k}.json").read_text()),
                        (DATA / f"metrics_{k}.txt").read_text(), WALL + 3 * k) for k in (1, 2)]


def _history(samples) -> History:
    h = History()
    for s in samples:
        h.add(s)
    return h


def _frame(view, compact: bool, width: int = 80, height: int = 24, status=None) -> str:
    console = Console(record=True, width=width, height=height, color_system=None)
    console.print(render(view, "http://127.0.0.1:8000", status, compact=compact, width=width, height=height))
    return console.export_text()


def _row(text: str, first: str) -> list[str]:
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == [first]]
    assert len(rows) == 1, text
    return rows[0]


@pytest.mark.parametrize("compact", [False, True])
def test_recorded_snapshots_render_rows_and_numbers(compact):
    s1, s2 = _recorded()
    text = _frame(_history([s1, s2]).view(), compact)
    dt = s2.time - s1.time  # 3.0248 s of server uptime
    assert dt == pytest.approx(3.0248, abs=1e-4)
    # p0: 82 -> 341 prompt tokens = 85.6/s; 4 raw, 7 in a sched batch, 7 running; 718/728 blocks free
    assert _row(text, "p0") == ["p0", "cpu", "prefill", "4", "7", "-", "7", "▏░░░░░", "1%", "86", "0", "75%", "oracle"]
    # d1: 13 -> 167 generated tokens = 50.9/s; 698/728 blocks free = 4.1 % used; busy all the window
    assert _row(text, "d1") == ["d1", "cpu", "decode", "0", "-", "0", "14", "▎░░░░░", "4%", "0", "51", "100%",
                                "oracle"]
    # 5 TTFTs, all in the window: cumulative (0.75: 1, 1.0: 1, 1.5: 4, 2.5: 5); p50 rank 2.5 lands in
    # (1.0, 1.5]: 1.0 + 0.5 * (2.5 - 1) / (4 - 1) = 1.25; p99 rank 4.95: 1.5 + 1.0 * 0.95 = 2.45
    assert "TTFT p50 1.25s p99 2.45s" in text
    assert "last 3s, 5 req" in text
    assert "finished 5" in text and "25 in flight (11 waiting)" in text
    assert _row(text, "p0→d1")[:4] == ["p0→d1", "nvlink", "2.6", "MB/s"]  # 7741440 B over 3.02 s
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    assert len(lines) <= 24 or not compact


def test_compact_frame_fits_80x24_with_a_big_cluster():
    s1, s2 = _recorded()
    big = []
    for s in (s1, s2):
        stats = copy.deepcopy(s.stats)
        proto_i, proto_l = stats["instances"], stats["links"][0]
        stats["instances"] = [dict(proto_i[k % 2], id=f"{'pd'[k % 2]}{k}", device=f"cuda:{k}") for k in range(16)]
        stats["links"] = [dict(proto_l, src=f"p{a}", dst=f"d{b}") for a in range(0, 16, 2) for b in range(1, 16, 2)]
        stats["events"] = [{"time": WALL + k, "kind": "flip", "message": f"d{k} decode -> prefill, a long message "
                            "that would not fit in eighty columns without an ellipsis at its end"} for k in range(40)]
        big.append(Sample(stats, s.histograms, s.wall))
    view = _history(big).view()
    text = _frame(view, compact=True, status="connection lost: http://127.0.0.1:8000 (refused); retrying")
    lines = text.splitlines()
    assert len(lines) <= 24 and max(map(len, lines)) <= 80, text
    assert "more" in text and "connection lost" in text and "flip" in text
    assert len(_frame(view, compact=False, width=120, height=60).splitlines()) > 24  # full mode shows it all


# ---- events and reconnects ---------------------------------------------------------------------------
def _stats(uptime: float, **instance) -> dict:
    inst = {"id": "d1", "role": "decode", "state": "active", "device": "cpu", "free_blocks": 10,
            "total_blocks": 10, "num_preemptions": 0, "num_decode_tokens": 0, **instance}
    return {"model": "m", "mode": "disagg", "uptime_s": uptime, "counts": {"finished": 0, "aborted": 0},
            "instances": [inst], "links": []}


def test_events_from_counter_changes_and_the_servers_log():
    h = History()
    h.add(Sample(_stats(1.0), {}, WALL))
    later = _stats(2.0, state="draining", num_preemptions=3, role="prefill")
    later["counts"] = {"finished": 0, "aborted": 2, "rejected": 1}
    h.add(Sample(later, {}, WALL + 1))
    kinds = [(e.kind, e.message) for e in h.events]
    assert ("flip", "d1 flipped decode → prefill") in kinds
    assert ("state", "d1 active → draining") in kinds
    assert ("preemption", "d1: 3 request(s) preempted") in kinds
    assert ("aborted", "2 request(s) aborted") in kinds and ("rejected", "1 request(s) rejected") in kinds
    # a server that keeps its own log: its events show once, and flips are not derived twice
    logged = _stats(3.0, role="decode")
    logged["events"] = [{"time": WALL + 2, "kind": "flip", "instance": "d1", "message": "prefill -> decode"}]
    h.add(Sample(logged, {}, WALL + 2))
    h.add(Sample(dict(logged, uptime_s=4.0), {}, WALL + 3))
    flips = [e for e in h.events if e.kind == "flip"]
    assert [e.message for e in flips] == ["d1 flipped decode → prefill", "prefill -> decode"]
    assert "flip" in _frame(h.view(), compact=True)


def test_dashboard_survives_lost_connections_and_restarts():
    board = Dashboard("http://127.0.0.1:8000")
    board.feed(Sample(_stats(10.0, num_decode_tokens=100), {}, WALL))
    board.lost(FetchError("[Errno 111] Connection refused"), 1.0)
    text = _frame(board.history.view(), compact=True, status=board.status)
    assert "connection lost: http://127.0.0.1:8000" in text and "d1" in text, "the last data stays on screen"
    board.feed(Sample(_stats(12.0, num_decode_tokens=300), {}, WALL + 5))  # same server, back
    assert board.status is None and board.history.view().instances[0].decode_tps == pytest.approx(100.0)
    board.feed(Sample(_stats(0.5, num_decode_tokens=5), {}, WALL + 6))  # uptime went back: a new server
    view = board.history.view()
    assert view.instances[0].decode_tps is None and view.events[-1].kind == "restart"


def test_parse_url():
    assert parse_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    for bad in ("127.0.0.1:8000", "http://", "http://h:99999", "http://h:80/x"):
        with pytest.raises(ValueError, match="--url"):
            parse_url(bad)


# ---- the command line ------------------------------------------------------------------------------
def _aserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_monitor_starts_without_torch():
    """``aserve monitor`` is a client: the command layer and the dashboard import no torch (it cost
    every monitor start 2-4 s here, before the first frame or a usage error)."""
    code = ("import sys; from aserve.commands import build_parser; import aserve.monitor.dashboard; "
            "build_parser().parse_args(['monitor', '--once']); print(sorted(m for m in ('torch', 'model.loader') "
            "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


def test_malformed_url_is_a_usage_error():
    r = _aserve("monitor", "--url", "localhost:8000", "--once")
    assert r.returncode == 2 and r.stderr.startswith("aserve: error: bad --url"), r.stderr


def test_once_without_a_server_says_connection_lost():
    url = f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    r = _aserve("monitor", "--url", url, "--once", "--interval", "0.2")
    assert r.returncode == 0, r.stderr
    assert "connection lost" in r.stdout and url in r.stdout and "3 tries" in r.stdout
    assert "Traceback" not in r.stderr + r.stdout
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_live_monitor_keeps_running_and_exits_0_on_ctrl_c(sig):
    # A socket that accepts and hangs up at once: the monitor sees a lost connection each poll,
    # and the accepts tell the test that the monitor's loop (and its signal handling) is running,
    # however slowly the machine imports.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(120)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "monitor", "--url", url, "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for _ in range(3):  # several polls that lost the connection
            conn, _addr = listener.accept()
            conn.close()
        assert proc.poll() is None, "the monitor must outlive a missing server"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
        listener.close()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "connection lost" in out


def test_once_against_something_that_is_not_aserve():
    """A plain HTTP server that answers 404: an error (exit 1), not a lost connection."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        r = _aserve("monitor", "--once", "--url", f"http://127.0.0.1:{httpd.server_port}", "--interval", "0.2")
    finally:
        httpd.shutdown()
    assert r.returncode == 1 and "aserve: error:" in r.stderr and "HTTP 404 on /v1/stats" in r.stderr, r
    assert "Traceback" not in r.stderr


# ---- against a real server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    from aserve.config import ClusterConfig
    from tests.api_support import ServerThread

    with ServerThread(ClusterConfig(mode="disagg", num_prefill=1, num_decode=1)) as s:
        yield s


class _Load:
    """Streaming completions with the openai client, two at a time, until stopped."""

    def __init__(self, url: str):
        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.stop, self.num_done = threading.Event(), 0
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(2)]

    def _loop(self, i: int) -> None:
        while not self.stop.is_set():
            stream = self.client.completions.create(model="default", prompt=f"Count to ten, take {i}:",
                                                    max_tokens=8, stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                pass
            self.num_done += 1

    def __enter__(self) -> "_Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


@pytest.mark.long  # 18 s; the snapshot it reads is checked by test_json_prints_the_snapshot, its rendering by the recorded ones
@pytest.mark.slow
def test_monitor_once_against_a_loaded_server(server):
    # On a slow CPU (fp32, 2.5 s to a first token while the server warms) a 2-s window can hold no
    # prefill step at all: wait for the load to finish requests first, and read up to three windows.
    with _Load(server.url) as load:
        deadline = time.monotonic() + 60
        while load.num_done < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        for _ in range(3):
            r = _aserve("monitor", "--once", "--url", server.url, "--interval", "2")
            assert r.returncode == 0, r.stderr
            p0, d1 = _row(r.stdout, "p0"), _row(r.stdout, "d1")
            # columns: ... KV-bar pct pre/s dec/s busy pred
            if float(p0[-4].rstrip("k")) > 0 and float(d1[-3].rstrip("k")) > 0:
                break
    assert load.num_done > 0
    assert p0[:3] == ["p0", "cpu", "prefill"] and d1[:3] == ["d1", "cpu", "decode"], r.stdout
    assert float(p0[-4].rstrip("k")) > 0, f"prefill tokens/s: {r.stdout}"
    assert float(d1[-3].rstrip("k")) > 0, f"decode tokens/s: {r.stdout}"
    assert "p0→d1" in r.stdout and "TTFT p50" in r.stdout
    server.wait_idle()


@pytest.mark.slow
def test_json_prints_the_snapshot(server):
    r = _aserve("monitor", "--json", "--url", server.url + "/v1")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert {i["id"] for i in stats["instances"]} == {"p0", "d1"}
    assert {"num_scheduled", "num_receiving", "predictor"} <= stats["instances"][0].keys()


@pytest.mark.slow
def test_api_key_is_sent_and_a_wrong_one_is_an_error():
    from aserve.api.server import ServerSettings
    from aserve.config import ClusterConfig
    from tests.api_support import ServerThread

    with ServerThread(ClusterConfig(mode="coupled", num_coupled=1), ServerSettings(api_key="sesame")) as s:
        wrong = _aserve("monitor", "--json", "--url", s.url, "--api-key", "nope")
        right = _aserve("monitor", "--json", "--url", s.url, "--api-key", "sesame")
    assert wrong.returncode == 1 and "HTTP 401" in wrong.stderr and "--api-key" in wrong.stderr, wrong
    assert right.returncode == 0 and [i["id"] for i in json.loads(right.stdout)["instances"]] == ["c0"], right


@pytest.mark.slow
def test_in_process_tui_draws_from_the_servers_own_snapshot(server):
    """``serve --tui``'s drawing loop, on the server's event loop (the thread rule)."""
    console = Console(record=True, width=80, height=24, color_system=None)
    with _Load(server.url):
        task = asyncio.run_coroutine_threadsafe(
            run_in_process(server_sampler(server.server.ctx), server.url, 0.5, console), server._loop)
        time.sleep(3)
        task.cancel()
    text = console.export_text()
    assert _row(text, "p0")[:3] == ["p0", "cpu", "prefill"] and "d1" in text, text
    server.wait_idle()


@pytest.mark.slow
def test_serve_tui_draws_then_gives_the_terminal_back_to_the_drain(capsys):
    """``run_server(tui=True)``, as ``aserve serve --tui`` calls it: frames while serving, and the
    monitor stopped before the drain's message."""
    from aserve.api.server import run_server
    from aserve.cluster.cluster import Cluster
    from aserve.config import ClusterConfig
    from tests.api_support import ENGINE, bundle

    async def serve_briefly():
        stop = asyncio.Event()
        async with Cluster(ENGINE, ClusterConfig(mode="coupled", num_coupled=1), bundle=bundle()) as cluster:
            asyncio.get_running_loop().call_later(2.5, stop.set)
            await run_server(cluster, "m", port=0, stop=stop, handle_signals=False, tui=True)

    asyncio.run(serve_briefly())
    out, err = capsys.readouterr()
    assert _row(out, "c0")[:3] == ["c0", "cpu", "coupled"], out
    assert "aserve: draining" in err and "monitor failed" not in err
