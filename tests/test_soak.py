"""``aserve soak`` (aserve/soak/): its pieces on made-up data, then a 2-minute soak on the real
default model, 2 prefill + 2 decode instances, every fault on: no request lost, no block leaked."""
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aserve.replay.traces import Trace, TraceRequest
from aserve.soak.client import SoakRecord, cycle
from aserve.soak.report import build_report, requests_summary
from aserve.soak.settings import FAULTS, SoakConfig

ROOT = Path(__file__).resolve().parents[1]


def _trace(arrivals) -> Trace:
    return Trace(tuple(TraceRequest(a, 10, 5) for a in arrivals), "test", "test")


def test_the_trace_is_cycled_for_the_duration():
    """Three arrivals 1 s apart make a 3 s span (last arrival plus the mean gap), repeated."""
    got = [(i, at) for i, at, _ in cycle(_trace([0.0, 1.0, 2.0]), 7.0)]
    assert got == [(0, 0.0), (1, 1.0), (2, 2.0), (0, 3.0), (1, 4.0), (2, 5.0), (0, 6.0)]
    with pytest.raises(ValueError, match="give --rate"):
        list(cycle(_trace([0.0, 0.0]), 5.0))


def test_soak_settings_are_checked():
    cfg = SoakConfig(duration_s=1800)
    assert cfg.warmup == 60.0 and SoakConfig(duration_s=120).warmup == 12.0
    assert cfg.faults_for("coupled") == ("kill",) and cfg.faults_for("disagg") == FAULTS
    with pytest.raises(ValueError, match="duration_s must be > 0"):
        SoakConfig(duration_s=0)
    with pytest.raises(ValueError, match="unknown fault 'meteor'"):
        SoakConfig(duration_s=10, faults=("kill", "meteor"))
    with pytest.raises(ValueError, match="cut_fraction must be in"):
        SoakConfig(duration_s=10, cut_fraction=1.5)
    with pytest.raises(ValueError, match="readd_after_s must be a range"):
        SoakConfig(duration_s=10, readd_after_s=(5.0, 1.0))
    with pytest.raises(ValueError, match="warmup_s must be in"):
        SoakConfig(duration_s=10, warmup_s=10)


def _record(i, outcome, plan="complete", server_id=None, usage=5, error=None):
    return SoakRecord(i, float(i), 10, 5, True, plan, outcome=outcome, usage_tokens=usage,
                      server_id=server_id or f"cmpl-{i}", error=error)


def test_lost_counts_the_client_and_the_table_once_each():
    records = [_record(0, "completed"), _record(1, "lost", error="the stream ended without [DONE]"),
               _record(2, "aborted", plan="abort"), _record(3, "aborted"), _record(4, "errored", error="HTTP 500: x"),
               _record(5, "completed", usage=3), _record(6, "disconnected", plan="disconnect")]
    got = requests_summary(records, leftover=["cmpl-1", "cmpl-9"])
    assert (got["sent"], got["completed"], got["errored"], got["aborted"], got["disconnected"]) == (7, 2, 1, 2, 1)
    assert got["lost"] == 2  # cmpl-1 once (the client saw it too), cmpl-9 left in the table
    assert got["unasked_aborts"] == 1 and got["wrong_length"] == 1
    assert got["top_errors"] == [("HTTP 500: x", 1)]


class _NoFaults:
    counts, events, removed = {"kill": 1}, [(3.0, "kill", "d2")], [lambda: None]

    def removed_alive(self):
        return 0

    def kill_report(self):
        return [{"instance": "d2", "role": "decode", "at_s": 3.0, "requests_hit": 2, "recovery_s": 0.4}]


def test_report_figures_and_invariants(tmp_path):
    from aserve.soak.report import write_plot

    samples = [{"t": t, "rss_bytes": 1000 + (50 if t >= 5 else 0), "open_sockets": 10, "server_connections": 2,
                "requests": 1, "loop_lag_s": 0.01 * t, "free_blocks": {"p0": 100, "d2": 90}, "states": {}}
               for t in range(10)]
    end = {"leftover_requests": [], "leaked_blocks": {"p0": 0, "d2": 0}, "links_in_flight": 0}
    report = build_report({"system": "t", "duration_s": 10.0}, [_record(0, "completed")], end, samples,
                          [0.001] * 98 + [0.2, 0.3], _NoFaults(), {"disconnect": 0}, warmup_s=5.0)
    assert report["lost"] == 0 and report["leaked_blocks"] == 0 and report["ok"]
    assert report["rss_growth"] == 0.0 and report["rss_after_warmup_bytes"] == 1050  # measured after the warm-up
    assert report["loop_lag_max_s"] == 0.3 and report["loop_lag_p99_s"] == pytest.approx(0.201, abs=1e-3)
    assert not report["invariants"]["loop_lag_p99_s"]["ok"] and report["invariants"]["rss_growth"]["ok"]
    assert report["max_recovery_s"] == 0.4 and report["faults"] == {"disconnect": 0, "kill": 1}
    json.dumps(report)  # plain JSON values only
    assert write_plot(report, tmp_path / "soak.png").stat().st_size > 10_000


def test_rss_growth_ends_at_the_settled_level_not_amid_faults():
    """The end level is the idle one after the soak settles; the last loaded seconds are kept beside it.
    Without a settled time it falls back to the last 10 s."""
    from aserve.soak.report import memory_summary

    rss = {t: 1000 if t < 12 else (1100 if t < 18 else 1010) for t in range(21)}
    samples = [{"t": float(t), "rss_bytes": b} for t, b in rss.items()]
    got = memory_summary(samples, warmup_s=2.0, settled_s=18.0)
    assert got["rss_after_warmup_bytes"] == 1000 and got["rss_end_bytes"] == 1010
    assert got["rss_growth"] == pytest.approx(0.01) and got["rss_settled_samples"] == 3
    assert got["rss_end_loaded_bytes"] == 1100 and got["rss_growth_loaded"] == pytest.approx(0.1)
    unsettled = memory_summary(samples, warmup_s=2.0)
    assert unsettled["rss_end_bytes"] == 1100 and unsettled["rss_settled_samples"] == 0


@pytest.mark.slow
@pytest.mark.long  # 2.5 min: make test leaves it out to stay under 15 minutes; CI runs it (make test-ci-long)
def test_two_minute_soak_loses_nothing_and_leaks_nothing(tmp_path):
    """The issue's 2-minute soak: 2 prefill + 2 decode instances over the Mixed workload (lengths
    scaled to fit two cores), every server-side fault every few seconds, a third of the requests
    cut. Asserts the 30-minute soak's invariants: lost == 0, leaked_blocks == 0, no removed
    instance's device still held at the end, RSS growth after the warm-up under 5% (standalone
    runs: 0.7-1.0%) and loop-lag p99 under 50 ms (3-5 ms here; the 30-minute runs: 6-7 ms).

    It runs ``aserve soak`` in a process of its own, as a user would: RSS is then the server's,
    not this test process's, which carries the allocations of every test before it (in the suite
    it was 5.3-5.6 GB, and its growth moved with them: +5.5% and +7.7% in two CI runs where the
    soak alone measures under 1%). Each re-add swaps a 0.1 GB pool, about 5% of the soak's
    process, so a pool that outlived its instance shows; a failure prints the RSS steps.

    RSS growth is taken after a 40 s warm-up: on an AVX2 CPU (fp32, torch's own matrix products)
    RSS climbs for the first 45 s as the allocator warms (1,354 -> 1,402 MB in one run, 1,432 ->
    1,472 in another) and then moves +-30 MB with the re-adds, so growth from the default 12 s
    read 3.0% alone and 7.0% in CI's suite with 0 of 9 removed devices alive. A leaked pool per
    re-add would still add 0.1 GB at each of the ~6 re-adds after 40 s. The fault schedule removed
    9 instances on that CPU and 10 or more on the AVX512 one; 6 is enough to show none outlives
    its removal. Growth compares RSS levels (medians: aserve/soak/report.py): 10 s after the
    warm-up, and 5 s once the soak has settled (faults stopped, re-adds made, nothing running), so
    one sample taken between a pool's free and its replacement's making does not count, nor an end
    window still under faults (CI, 2026-11-28: +5.7% over a last 10 s holding a kill and two
    re-adds, 0 of 9 removed devices alive)."""
    out, plot = tmp_path / "soak.json", tmp_path / "soak.png"
    run = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "soak", str(ROOT / "traces" / "Mixed.jsonl"), "--duration", "120",
         "--json", str(out), "--plot", str(plot), "--length-scale", "0.05", "--max-output-tokens", "64",
         "--rate", "1.5", "--warmup", "40", "--mode", "disagg", "--prefill", "2", "--decode", "2", "--kv-cache-gb", "0.1",
         "--threads", "2", "--chunk-size", "128", "--max-num-batched-tokens", "512", "--transfer-timeout", "1",
         "--lease", "10", "--fault-interval", "4", "--readd-after", "2", "6", "--drain-timeout", "60"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(run.stdout[-4000:], run.stderr[-4000:])
    assert out.exists(), run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["lost"] == 0, report["lost_examples"]
    assert report["leaked_blocks"] == 0, report["leaked_by_instance"]
    assert report["loop_lag_p99_s"] < 0.05, (report["loop_lag_p99_s"], report["loop_lag_max_s"])
    assert report["removed"] >= 6 and report["removed_alive"] == 0, (report["removed"], report["removed_alive"])
    assert report["rss_growth"] < 0.05, _rss_steps(report)
    assert run.returncode == 0 and plot.stat().st_size > 10_000
    assert report["completed"] > 50 and report["disconnected"] > 0 and report["aborted"] > 0
    for kind in ("kill", "readd", "transfer_fail", "transfer_stall"):
        assert report["faults"].get(kind, 0) > 0, (kind, report["faults"])
    assert report["kills"] and all(k["recovery_s"] is not None for k in report["kills"])
    assert report["cluster_counts"]["transfer_failures"] > 0 and report["cluster_counts"]["instance_failures"] > 0


def _rss_steps(report) -> str:
    """Where RSS moved by more than 20 MB between samples, beside the kills and re-adds."""
    steps, prev = [], None
    for t, b in report["rss_series"]:
        if prev is not None and abs(b - prev) > 20 * 2**20:
            steps.append(f"{t:.1f}s {(b - prev) / 2**20:+.0f} MB")
        prev = b
    events = [f"{t:.1f}s {kind}" for t, kind, _ in report["fault_events"] if kind in ("kill", "readd")]
    return (f"growth {report['rss_growth']:.3f} (after warm-up {report['rss_after_warmup_bytes'] / 2**20:.0f} MB, "
            f"end {report['rss_end_bytes'] / 2**20:.0f} MB); steps {steps}; events {events}")
