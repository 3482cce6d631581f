"""benchmarks/prefix_cache_sim.py: the small-pool profile it writes is the V100's with less KV and the
same step costs, and the systems' three ways are the flags the issue names."""
import importlib.util
import sys
from pathlib import Path

from aserve.devices.sim_device import load_profile

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "prefix_cache_sim.py"
spec = importlib.util.spec_from_file_location("prefix_cache_sim", SCRIPT)
prefix_cache_sim = importlib.util.module_from_spec(spec)
sys.modules["prefix_cache_sim"] = prefix_cache_sim
spec.loader.exec_module(prefix_cache_sim)


def test_the_small_pool_profile_holds_the_tokens_asked_at_the_same_costs(tmp_path):
    shipped = load_profile("opt-13b-v100-32gb")
    assert shipped.kv_capacity_bytes // 819_200 == 5_065  # what the notes and the page say a V100 holds
    path = prefix_cache_sim.pressure_profile(tmp_path, 2_560)
    small = load_profile(str(path))
    assert small.kv_capacity_bytes == 2_560 * 819_200
    assert small.cost == shipped.cost and small.model == shipped.model
    assert small.name == "opt-13b-v100-32gb-kv2560"


def test_each_system_runs_cached_with_placement_cached_alone_and_uncached():
    text = prefix_cache_sim.compare(["sarathi"])
    assert text == ("sarathi: --mode coupled --instances 4 --batching sarathi ; "
                    "sarathi-noplace: --mode coupled --instances 4 --batching sarathi --no-prefix-aware-placement ; "
                    "sarathi-nocache: --mode coupled --instances 4 --batching sarathi --no-enable-prefix-caching")
