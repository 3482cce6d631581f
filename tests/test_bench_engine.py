"""``aserve bench engine --quick`` end to end on the real default model: the JSON holds every
figure the issue names, and the derived ones follow from the measured ones."""
import json
import statistics

import pytest

from aserve.bench.engine import run_engine_bench
from aserve.config import EngineConfig

# long (20-25 s here): make test leaves it out; CI runs it after make test (make test-ci-long)
pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.mark.parametrize("kernels", ["auto", "fallback"])
def test_quick_engine_bench_writes_consistent_figures(tmp_path, kernels):
    out = tmp_path / "bench.json"
    assert run_engine_bench(EngineConfig(kernels=kernels), str(out), quick=True) == 0
    r = json.loads(out.read_text())
    if kernels == "fallback":  # measured on torch's own ops, when asked
        assert r["kernels"] == "fallback" and r["attention"] == "sdpa"
    sizes = {int(n) for n in r["prefill"]}
    assert r["saturate_chunk"] in sizes
    best = max(v["tokens_per_s"] for v in r["prefill"].values())
    assert r["prefill"][str(r["saturate_chunk"])]["tokens_per_s"] >= 0.9 * best
    assert all(v["step_ms"] > 0 for v in r["decode"].values())
    assert r["generate_speedup"] == pytest.approx(r["hf_generate_s"] / r["aserve_generate_s"])
    assert r["generate_speedup"] == pytest.approx(r["aserve_generate_tokens_per_s"] / r["hf_generate_tokens_per_s"])
    rounds = r["roofline_rounds"]
    assert len(rounds) == 2
    for x in rounds:  # each round's ratio is its own step against its own probe
        assert x["vs_roofline"] == pytest.approx(x["step_ms"] / (r["weight_bytes"] / (x["read_gb_s"] * 1e9) * 1e3))
    assert r["decode_step_vs_roofline"] == pytest.approx(statistics.median(x["vs_roofline"] for x in rounds))
    assert r["roofline_decode_step_ms"] == pytest.approx(r["weight_bytes"] / (r["memory_bandwidth_gb_s"] * 1e9) * 1e3)
    assert r["decode_step_vs_copy_roofline"] == pytest.approx(statistics.median(x["vs_copy_roofline"] for x in rounds))
