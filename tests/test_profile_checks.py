"""A measured profile knows what it measured (issue 58): checked against the instances it times,
taken at rest, warned about when old, busy or of another machine; and the second hardware
profile, Llama-3-8B on an H100, from public figures (unit tier: no model, virtual time)."""
from __future__ import annotations

import json
from datetime import date, timedelta

import pytest

from aserve.config import ClusterConfig, EngineConfig
from aserve.profiles import profile_check, rest
from aserve.profiles.cost_model import CostModel
from aserve.profiles.machine import cpu_flags, machine

FLAT = CostModel(tokens=(1, 1001), linear_s=(0.011, 1.011), attn_prefill_s=0.0, attn_decode_s=0.0)
AT_REST = rest.verdict(0.02, 0.03, 0.020, 0.0205)
# a profile measured here with explicit settings (so nothing resolves ``auto``: no kernels to build)
MEASURED = {"model": "default", "device": "cpu", "dtype": "float32", "attention": "sdpa", "kernels": "fallback",
            "threads": 2, "machine": machine(), "cpu_flags": cpu_flags(), "date": date.today().isoformat(),
            "rest": AT_REST}
SETTINGS = dict(dtype="fp32", attention="sdpa", kernels="fallback")


def profile_file(tmp_path, **meta) -> str:
    """A measured cost model (as ``aserve profile device --out`` writes one) with ``meta`` over MEASURED's."""
    path = tmp_path / "P.json"
    path.write_text(json.dumps(CostModel(FLAT.tokens, FLAT.linear_s, 0.0, 0.0, meta={**MEASURED, **meta}).to_json()))
    return str(path)


def cost_for(path: str, threads: int, **settings):
    """What a simulated instance of ``settings`` at ``threads`` torch threads gets from ``sim:path``."""
    from aserve.devices.factory import device_cost

    return device_cost(EngineConfig(device=f"sim:{path}", **{**SETTINGS, **settings}), threads)


def test_a_profile_of_other_threads_is_refused_with_the_command_that_measures_the_right_one(tmp_path):
    """The issue's case: measured at two threads, simulating 1P + 1D at one thread each."""
    path = profile_file(tmp_path)
    assert cost_for(path, 2).meta["threads"] == 2  # what it was measured for: used as is
    with pytest.raises(ValueError) as refused:
        cost_for(path, 1)
    text = str(refused.value)
    assert f"sim:{path} was measured for another engine than the one simulated: threads 2 in the profile, 1 for " \
           "these instances" in text
    assert f"aserve profile device --threads 1 --dtype fp32 --attention sdpa --kernels fallback --out {path}" in text
    assert "--allow-profile-mismatch" in text


def test_every_mismatched_field_is_named(tmp_path):
    path = profile_file(tmp_path, model="/models/other", dtype="bfloat16", attention="reference", kernels="unfused")
    with pytest.raises(ValueError) as refused:
        cost_for(path, 2)
    text = str(refused.value)
    for field in ("model /models/other in the profile, default", "dtype bfloat16 in the profile, float32",
                  "attention reference in the profile, sdpa", "kernels unfused in the profile, fallback"):
        assert field in text
    assert "threads 2 in the profile" not in text  # threads match: not named


def test_allow_profile_mismatch_warns_instead(tmp_path, capsys):
    path = profile_file(tmp_path, attention="reference")
    cost = cost_for(path, 1, allow_profile_mismatch=True)
    assert cost.meta["attention"] == "reference"
    err = capsys.readouterr().err
    assert "aserve: warning:" in err and "threads 2 in the profile, 1 for these instances" in err
    assert "used anyway (--allow-profile-mismatch)" in err


def test_an_old_profile_without_a_field_is_used_with_a_word_on_what_is_unchecked(tmp_path, capsys):
    """Measured before threads, kernels, flags and rest were recorded: nothing to refuse it by."""
    path = tmp_path / "old.json"
    old = {"model": "default", "device": "cpu", "dtype": "float32", "machine": machine(), "date": "2026-11-28"}
    path.write_text(json.dumps(CostModel(FLAT.tokens, FLAT.linear_s, 0.0, 0.0, meta=old).to_json()))
    assert cost_for(str(path), 1).linear_s == FLAT.linear_s
    err = capsys.readouterr().err
    assert f"sim:{path} does not record threads, attention, kernels, cpu_flags, rest" in err
    assert "nothing says it was measured at rest" in err


def test_auto_settings_of_a_profile_of_another_machine_mean_what_that_machine_chose():
    """On another machine ``auto`` may have resolved otherwise: only explicit settings are compared
    (and threads, the model); on this machine ``auto`` resolves as the instances would."""
    meta = {**MEASURED, "machine": "another CPU, 64 cores", "dtype": "bfloat16", "attention": "native"}
    auto = EngineConfig(device="sim:x.json")
    assert profile_check.instance_fields(auto, 1, meta, same_machine=False) == {"model": "default", "threads": 1}
    explicit = EngineConfig(device="sim:x.json", dtype="fp32", attention="sdpa", kernels="fallback")
    assert profile_check.instance_fields(explicit, 4, meta, same_machine=False) == {
        "model": "default", "threads": 4, "dtype": "float32", "kernels": "fallback", "attention": "sdpa"}
    gpu = {**meta, "device": "cuda:0"}  # torch threads do not set a GPU's speed
    assert "threads" not in profile_check.instance_fields(explicit, 4, gpu, same_machine=False)


def test_load_warnings_busy_old_and_another_machine():
    today = date(2026, 11, 29)
    meta = {**MEASURED, "date": "2026-11-28"}
    assert profile_check.load_warnings("P", meta, machine(), cpu_flags(), today) == []
    busy = {**meta, "rest": rest.verdict(1.3, 0.9, 0.020, 0.031, allowed_busy=True)}
    (line,) = profile_check.load_warnings("P", busy, machine(), cpu_flags(), today, "aserve profile device --threads 2")
    assert "not at rest (other processes used 1.30 cores before the measurement" in line
    assert "the probe step ran 55% slower at the end" in line and "kept with --allow-busy" in line
    assert line.endswith("Measure again at rest: aserve profile device --threads 2")
    old = {**meta, "date": (today - timedelta(days=45)).isoformat()}
    (line,) = profile_check.load_warnings("P", old, machine(), cpu_flags(), today)
    assert "measured 45 days ago" in line
    (line,) = profile_check.load_warnings("P", meta, "another CPU, 2 cores", cpu_flags(), today)
    assert "was measured on " + machine() in line and "not this machine (another CPU, 2 cores)" in line
    (line,) = profile_check.load_warnings("P", {**meta, "cpu_flags": ["avx", "avx2", "avx512f"]}, machine(),
                                          ["avx", "avx2"], today)
    assert "flags avx avx2 avx512f, this one has avx avx2" in line


def test_the_measure_command_names_what_the_instances_set():
    assert profile_check.measure_command(EngineConfig(), 1) == "aserve profile device --threads 1"
    cfg = EngineConfig(model="/m/llama", dtype="bf16", attention="sdpa", kernels="fallback")
    want = ("aserve profile device --threads 2 --model /m/llama --dtype bf16 --attention sdpa --kernels fallback "
            "--out P.json")
    assert profile_check.measure_command(cfg, 2, "P.json") == want


def test_cpu_flags_keep_the_isa_flags_that_pick_kernels():
    info = "processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2 avx512f avx512_bf16 sha_ni\n\nflags\t\t: other\n"
    assert cpu_flags(info) == ["avx", "avx2", "fma", "avx512f", "avx512_bf16"]  # ISA_FLAGS' order, first line
    assert cpu_flags("") == []


# ---- at rest ---------------------------------------------------------------------------------------

def test_busy_seconds_read_every_busy_field_of_proc_stat():
    # user nice system idle iowait irq softirq steal guest guest_nice (guest is inside user already)
    stat = "cpu  100 20 30 9000 50 5 5 40 70 0\ncpu0 50 10 15 4500 25 2 3 20 35 0\nintr 1 2 3\n"
    assert rest.busy_seconds(stat, 100) == pytest.approx((100 + 20 + 30 + 5 + 5 + 40) / 100)
    assert rest.busy_seconds(stat, 100, cpus={0}) == pytest.approx((50 + 10 + 15 + 2 + 3 + 20) / 100)  # ours only
    with pytest.raises(ValueError, match="no line for the aggregate cpu"):
        rest.busy_seconds("intr 1 2\n", 100)
    with pytest.raises(ValueError, match=r"no line for \[3\]"):
        rest.busy_seconds(stat, 100, cpus={3})


def test_others_cores_is_all_busy_time_less_this_process_own():
    a = rest.CpuSample(wall_s=10.0, busy_s=100.0, own_s=5.0)
    b = rest.CpuSample(wall_s=12.0, busy_s=103.5, own_s=6.9)  # 3.5 s busy in 2 s, 1.9 s of it ours
    assert rest.others_cores(a, b) == pytest.approx(0.8)
    assert rest.others_cores(a, rest.CpuSample(12.0, 101.0, 7.5)) == 0.0  # rounding never goes negative
    assert rest.others_cores(None, b) is None and rest.others_cores(b, a) is None


def test_the_verdict_holds_what_was_seen():
    assert AT_REST["at_rest"] and AT_REST["why"] == [] and AT_REST["probe_change"] == pytest.approx(0.025)
    busy = rest.verdict(0.1, 0.7, 0.020, 0.021)
    assert not busy["at_rest"] and busy["why"] == [
        "other processes used 0.70 cores during the measurement (at most 0.25 at rest)"]
    assert not busy["allowed_busy"] and rest.verdict(0.1, 0.7, allowed_busy=True)["allowed_busy"]
    drifted = rest.verdict(0.0, 0.0, 0.030, 0.020)
    assert drifted["why"] == ["the probe step ran 33% faster at the end than at the start (at most 20% at rest)"]
    unknown = rest.verdict(None, None)  # no /proc/stat, no probe: nothing says busy
    assert unknown["at_rest"] and rest.describe(unknown) == "no figures (no /proc/stat, no probe)"
    assert rest.describe(AT_REST) == "others 0.02 cores before, others 0.03 cores during, probe step +2.5% end to start"


# ---- Llama-3-8B on an H100 ---------------------------------------------------------------------------

H100 = "sim:llama3-8b-h100-80gb"


def test_the_h100_profile_loads_with_its_figures():
    from aserve.devices.sim_device import load_profile

    prof = load_profile("llama3-8b-h100-80gb")
    args = prof.model_args()
    assert args.kv_bytes_per_token == 131_072  # 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 B
    assert 420_000 < prof.kv_capacity_bytes // 131_072 < 470_000  # 90% of 80 GB less 16 GB of weights
    cost = prof.cost
    assert 0.0058 < cost.decode_s(1, 128) < 0.0065  # batch-1 decode: ~78% of the 16 GB read's roofline
    assert 0.008 < cost.decode_s(64, 1024) < 0.012  # 64 rows stream 64 x 1,024 tokens of KV more
    assert 30_000 < 2048 / cost.prefill_s(2048) < 40_000  # prompt tokens a second
    assert 768 <= cost.saturate_chunk(tile=64) <= 1280
    assert cost.contention == 0 and prof.host_swap_bytes == 80 * 2**30
    spec = json.loads((prof_dir() / "llama3-8b-h100-80gb.json").read_text())
    assert set(spec["efficiency"]) <= set(spec["why"]) and spec["sources"]  # every factor says why


def prof_dir():
    from aserve.devices.sim_device import PROFILE_DIR

    return PROFILE_DIR


@pytest.mark.parametrize("cluster", [
    ClusterConfig(mode="coupled", num_coupled=2, predictor="none"),
    ClusterConfig(mode="disagg", num_prefill=1, num_decode=1, chunk_size=1024, predictor="none")])
def test_a_short_replay_on_the_h100_completes(cluster):
    import random

    from aserve.cluster.cluster import Cluster
    from aserve.devices.virtual_time import VirtualClock, run_virtual
    from scheduling.request import SamplingParams
    from tests.cluster_support import settled, sim_bundle, stream_all

    bundle = sim_bundle(H100)
    engine = EngineConfig(device=H100, max_num_batched_tokens=2048)
    rng = random.Random(3)
    ids = [[rng.randrange(2, 500) for _ in range(rng.randrange(50, 1500))] for _ in range(12)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def main(clock):
        async with Cluster(engine, cluster, bundle=bundle, clock=clock) as cl:
            results = await stream_all(cl, ids, sp)
            await settled(cl, list(cl.instances))
            return results, clock.now()

    clock = VirtualClock()
    results, seconds = run_virtual(main(clock), clock)
    assert all(err is None and reason == "length" and len(toks) == 24 for toks, reason, err in results)
    assert 0.1 < seconds < 5  # 12 requests' prompts and 24 tokens each: well under a second of H100 time each
