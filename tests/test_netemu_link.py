"""Link profiles, the --link parser, KV size emulation and the pure LinkModel (FakeClock only)."""
import pytest

from netemu.link import LinkModel
from netemu.profiles import (PROFILES, KVEmulation, LinkProfile, model_kv_bytes_per_token,
                             parse_link)
from scheduling.clock import FakeClock

# 1000 B/s and 0.5 s latency keep the arithmetic readable: 1000 bytes alone = 1.5 s.
BW, LAT = 1000.0, 0.5


def make_model(num_copies: int = 1) -> tuple[LinkModel, FakeClock]:
    clock = FakeClock()
    return LinkModel(LinkProfile("test", BW, LAT, num_copies), clock), clock


# ---- profiles and parse_link ----------------------------------------------------------------

def test_builtin_profiles():
    assert PROFILES["nvlink"].bandwidth_bytes_per_s == 300e9
    assert PROFILES["roce"].bandwidth_bytes_per_s == 25e9
    assert PROFILES["pcie"].num_copies == 2
    assert all(0 < p.latency_s <= 10e-6 for p in PROFILES.values())
    # The indirect path pays both hops.
    assert PROFILES["pcie"].transfer_time(25e9) == pytest.approx(2 * (1 + 10e-6))


@pytest.mark.parametrize("spec, bw, lat, copies", [
    ("nvlink", 300e9, 3e-6, 1),
    ("ROCE", 25e9, 5e-6, 1),
    ("bw=200Gb/s,latency=5us", 25e9, 5e-6, 1),
    ("bw=100MB/s, latency=2ms", 100e6, 2e-3, 1),
    ("bw=1e3B/s,latency=1s,copies=2", 1e3, 1.0, 2),
    ("bw=1GiB/s,latency=0s", 2**30, 0.0, 1),
    ("bw=8Mb/s", 1e6, 0.0, 1),
    ("pcie,bw=16GB/s", 16e9, 10e-6, 2),
    ("roce,latency=10µs", 25e9, 10e-6, 1),
])
def test_parse_link(spec, bw, lat, copies):
    p = parse_link(spec)
    assert p.bandwidth_bytes_per_s == pytest.approx(bw)
    assert p.latency_s == pytest.approx(lat)
    assert p.num_copies == copies


@pytest.mark.parametrize("spec, field", [
    ("bw=fast,latency=1us", "bw"),
    ("bw=10GB,latency=1us", "bw"),
    ("bw=0GB/s,latency=1us", "bw"),
    ("latency=1us", "bw"),
    ("bw=1GB/s,latency=5", "latency"),
    ("bw=1GB/s,latency=5 parsecs", "latency"),
    ("bw=1GB/s,latency=-1ms", "latency"),
    ("bw=1GB/s,copies=0", "copies"),
    ("bw=1GB/s,jitter=1ms", "jitter"),
    ("warp", "link"),
    ("", "link"),
    ("nvlink,fast", "link"),
])
def test_parse_link_errors_name_the_field(spec, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        parse_link(spec)


def test_kv_bytes_per_token_table():
    assert model_kv_bytes_per_token("opt-13b") == 2 * 40 * 5120 * 2
    assert model_kv_bytes_per_token("facebook/opt-13b") == 819_200
    assert model_kv_bytes_per_token("meta-llama/Llama-2-7b-hf") == 2 * 32 * 4096 * 2
    assert model_kv_bytes_per_token("llama-2-13b") == 819_200
    assert model_kv_bytes_per_token("HuggingFaceTB/SmolLM2-135M") == 2 * 30 * 3 * 64 * 2
    with pytest.raises(ValueError, match="^emulate-model:"):
        model_kv_bytes_per_token("gpt-5")


def test_kv_emulation():
    assert KVEmulation().nbytes(num_tokens=100, real_nbytes=1234) == 1234
    emu = KVEmulation.from_args(model="opt-13b")
    assert emu.nbytes(num_tokens=100, real_nbytes=1234) == 100 * 819_200
    assert KVEmulation.from_args(kv_bytes_per_token=7).nbytes(3, 1) == 21
    assert KVEmulation.from_args() == KVEmulation()
    with pytest.raises(ValueError, match="not both"):
        KVEmulation.from_args(model="opt-13b", kv_bytes_per_token=7)
    with pytest.raises(ValueError, match="^emulate-kv-bytes-per-token:"):
        KVEmulation(0)


# ---- LinkModel ------------------------------------------------------------------------------

def test_one_transfer_takes_bytes_over_bandwidth_plus_latency():
    link, clock = make_model()
    link.start("a", 1000)
    assert link.finish_time("a") == pytest.approx(1000 / BW + LAT)
    clock.advance(0.7)  # the projection does not drift as time passes
    assert link.finish_time("a") == pytest.approx(1.5)


def test_two_started_together_share_equally():
    link, _ = make_model()
    link.start("a", 1000)
    link.start("b", 1000)
    assert link.num_sharing() == 2
    assert link.finish_time("a") == pytest.approx(2 * 1000 / BW + LAT)
    assert link.finish_time("b") == pytest.approx(2.5)


def test_started_halfway_is_piecewise():
    link, clock = make_model()
    link.start("a", 1000)
    clock.advance(0.5)
    assert link.finish_time("a") == pytest.approx(1.5)  # alone so far
    link.start("b", 1000)
    # a: 500 B left at 500 B/s -> data done at 1.5; b: 500 B done by then, 500 alone -> 2.0.
    assert link.finish_time("a") == pytest.approx(1.5 + LAT)
    assert link.finish_time("b") == pytest.approx(2.0 + LAT)
    clock.advance(1.2)  # t = 1.7: a's data is done, b moves alone
    assert link.num_sharing() == 1
    assert link.finish_times() == pytest.approx({"a": 2.0, "b": 2.5})


def test_latency_tail_takes_no_bandwidth():
    link, clock = make_model()
    link.start("a", 100)
    clock.advance(0.2)  # a's data ended at 0.1; it lands at 0.6
    link.start("b", 1000)
    assert link.finish_time("a") == pytest.approx(0.6)
    assert link.finish_time("b") == pytest.approx(0.2 + 1.0 + LAT)


def test_unequal_sizes_finish_in_order_and_advance_in_one_jump():
    link, clock = make_model()
    for tid, nbytes in (("s", 1000), ("m", 2000), ("l", 3000)):
        link.start(tid, nbytes)
    # 3 share until s ends (3000 B moved), 2 share until m ends, then l alone.
    assert link.finish_times() == pytest.approx({"s": 3.5, "m": 5.5, "l": 6.5})
    clock.advance(10.0)  # several pieces in one advance
    assert link.num_sharing() == 0
    assert link.finish_times() == pytest.approx({"s": 3.5, "m": 5.5, "l": 6.5})
    assert link.stats()["busy_s"] == pytest.approx(6.0)


def test_abort_gives_the_share_back():
    link, clock = make_model()
    link.start("a", 1000)
    link.start("b", 1000)
    clock.advance(0.5)  # 250 B each moved
    link.remove("b", completed=False)
    assert link.finish_time("a") == pytest.approx(0.5 + 0.75 + LAT)
    clock.advance(1.25)
    link.remove("a")
    s = link.stats()
    assert (s["in_flight"], s["num_done"], s["num_aborted"], s["bytes_moved"]) == (0, 1, 1, 1000)
    assert link.in_flight() == ()


def test_indirect_link_pays_every_hop():
    link, _ = make_model(num_copies=2)
    link.start("a", 1000)
    assert link.finish_time("a") == pytest.approx(2 * (1000 / BW + LAT))
    assert link.finish_time("a") == pytest.approx(link.profile.transfer_time(1000))


def test_zero_bytes_pays_latency_only():
    link, clock = make_model()
    clock.advance(3.0)
    link.start("a", 0)
    assert link.finish_time("a") == pytest.approx(3.0 + LAT)


def test_bad_calls():
    link, _ = make_model()
    link.start("a", 10)
    with pytest.raises(ValueError, match="already in flight"):
        link.start("a", 10)
    with pytest.raises(ValueError, match="nbytes"):
        link.start("b", -1)
    with pytest.raises(KeyError):
        link.finish_time("nope")
    assert link.in_flight() == ("a",)
