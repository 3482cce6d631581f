"""The step-cost model: hand-computed step times, the settings derived from it, the profile cache,
the command line's defaults, and a real (tiny-model) measurement."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from aserve.profiles.cost_model import CostModel, fit_attention, fit_prefill
from scheduling.step import GREEDY, SeqStep, StepPlan

# 10 ms a step up to 4 rows, then 1 ms a row; 2 ns a prompt pair, 50 ns a decode context token
COST = CostModel(tokens=(1, 4, 64, 256), linear_s=(0.010, 0.010, 0.070, 0.262),
                 attn_prefill_s=2e-9, attn_decode_s=50e-9, contention=0.5)


def test_step_times_by_hand():
    assert COST.linear(1) == COST.linear(0.5) == 0.010
    assert COST.linear(34) == pytest.approx(0.040)  # halfway from 4 to 64
    assert COST.linear(512) == pytest.approx(0.262 + 256 * 0.001)  # the last segment's slope
    assert COST.prefill_pairs(4, 10) == 4 * (10 + 2.5)
    # a chunk of 60 after 100 cached, two decodes at 500 and 700, 4 padding rows: 66 rows
    t = COST.step_s([(60, 100)], [500, 700], num_pad_tokens=4)
    assert t == pytest.approx(0.010 + (66 - 4) * 0.001 + 2e-9 * 60 * (100 + 30.5) + 50e-9 * 1200)
    assert COST.step_s([(60, 100)], [500, 700], 4, busy_neighbours=2) == pytest.approx(1.5 * t)
    plan = StepPlan((SeqStep("c", tuple(range(60)), 100, (0,)), SeqStep("d", (1,), 499, (0,), GREEDY),
                     SeqStep("e", (1,), 699, (0,), GREEDY)), num_pad_tokens=4)
    assert COST.plan_s(plan) == pytest.approx(t)
    # rows that sample no token (the chunk's 60, the 4 pads) take back their logits: the 2 decodes keep theirs
    logits = replace(COST, logits_row_s=1e-4)
    assert logits.plan_s(plan) == pytest.approx(t - 64e-4) == logits.step_s([(60, 100)], [500, 700], 4)
    last = StepPlan((SeqStep("c", tuple(range(60)), 100, (0,), GREEDY),), num_pad_tokens=4)  # a chunk that samples
    assert logits.plan_s(last) == pytest.approx(COST.plan_s(last) - 63e-4)
    assert COST.hybrid_s(40, 8, 300) == pytest.approx(COST.step_s([(32, 300)], [300] * 8))


def test_a_plan_costs_to_the_digit_what_its_shape_does():
    """``plan_s`` takes one pass over a plan's rows (a simulated device asks it every step): the
    same number as ``step_s`` of ``plan_shape``, to the last digit, for chunks, decode rows, empty
    rows, padding, rows that sample or not, and busy neighbours."""
    import random

    from aserve.profiles.cost_model import plan_shape

    rng = random.Random(0)
    for cost in (COST, replace(COST, logits_row_s=1e-4)):
        for _ in range(300):
            seqs = tuple(SeqStep(f"r{i}", tuple(range(rng.choice((0, 1, 1, 1, rng.randrange(2, 300))))),
                                 rng.randrange(0, 2000), (0,), GREEDY if rng.random() < 0.6 else None)
                         for i in range(rng.randrange(0, 12)))
            plan, busy = StepPlan(seqs, num_pad_tokens=rng.randrange(0, 40)), rng.randrange(0, 3)
            chunks, contexts, pad, sampled = plan_shape(plan)
            assert cost.plan_s(plan, busy) == cost.step_s(chunks, contexts, pad, busy, sampled)


def test_saturate_chunk_and_token_budget():
    # prefill tokens/s grows until the rows cost 1 ms each: the first chunk within 10% of the best
    chunk = COST.saturate_chunk(tile=16, max_chunk=256)
    rate = {n: n / COST.prefill_s(n) for n in range(16, 257, 16)}
    assert rate[chunk] >= 0.9 * max(rate.values()) > rate[chunk - 16]
    slo = COST.decode_slo_s(8, 300)
    assert slo == pytest.approx(5 * COST.decode_s(8, 300))
    budget = COST.token_budget(slo, 8, 300, tile=16)
    assert budget % 16 == 0 and COST.hybrid_s(budget, 8, 300) <= slo < COST.hybrid_s(budget + 16, 8, 300)
    assert COST.token_budget(1e-9, 8, 300, tile=16) == 16  # nothing meets it: the decodes alone


def test_files_and_bad_models(tmp_path):
    path = COST.save(tmp_path / "p.json")
    assert CostModel.load(path) == COST
    (tmp_path / "bad.json").write_text('{"tokens": [1]}')
    with pytest.raises(ValueError, match="linear_s"):
        CostModel.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="ascending"):
        CostModel((4, 1), (0.1, 0.1), 0.0, 0.0)
    assert fit_attention([(1.0, 2.0), (2.0, 4.0)]) == pytest.approx(2.0)
    assert fit_attention([(1.0, -3.0)]) == 0.0  # noise below the linear part: no negative cost


def test_a_prompt_rows_saving_is_fitted_apart_from_the_pairs():
    """Chunks timed as (rows sampling nothing, pairs, seconds beyond linear): the saving and the
    pair's price come back where the points hold both, and neither goes below its floor."""
    saving, per_pair = 5.8e-4, 1.0e-6
    shapes = ((128, 0), (128, 1024), (512, 0), (512, 1024))
    points = [(n - 1, CostModel.prefill_pairs(n, s), -saving * (n - 1) + per_pair * CostModel.prefill_pairs(n, s))
              for n, s in shapes]
    assert fit_prefill(points, floor=3.9e-4) == pytest.approx((saving, per_pair))
    # a saving under the LM head's own time is not believed: the floor, and the pairs refitted
    got_saving, got_pair = fit_prefill([(u, p, e + 5e-4 * u) for u, p, e in points], floor=3.9e-4)
    assert got_saving == 3.9e-4 and got_pair > 0
    assert fit_prefill([(127, 8256.0, 0.01)], floor=1e-4)[0] == 1e-4  # one point: the floor, the slope alone


def test_profile_cache_is_per_machine(tmp_path):
    from aserve.profiles.profile_store import cost_model, save_cost_model

    here = CostModel(COST.tokens, COST.linear_s, 1e-9, 1e-8, meta={"machine": "this one"})
    save_cost_model(str(tmp_path), "default", "cpu", "auto", 1, here)
    assert cost_model(str(tmp_path), "default", "cpu", "auto", 1, "this one") == here
    assert cost_model(str(tmp_path), "default", "cpu", "auto", 1, "another one") is None
    assert cost_model(str(tmp_path), "default", "cpu", "auto", 2, "this one") is None
    # a profile of an older measurement (no LM head timed: no version) is measured again
    assert cost_model(str(tmp_path), "default", "cpu", "auto", 1, "this one", version=2) is None
    save_cost_model(str(tmp_path), "default", "cpu", "auto", 1, replace(here, meta={**here.meta, "version": 2}))
    assert cost_model(str(tmp_path), "default", "cpu", "auto", 1, "this one", version=2).meta["version"] == 2


def test_command_line_defaults_come_from_the_profile(tmp_path):
    """The flags leave the measured defaults unset, and one start-up step (``measured.resolve``,
    which ``Cluster`` runs too) fills them in from the saved profile; resolving twice changes nothing."""
    from aserve.profiles.device_profile import identity
    from aserve.commands import build_parser
    from aserve.commands.common import cluster_config, engine_and_cluster, engine_config
    from aserve.devices.measured import BUDGET_DECODE_BATCH, model_context, resolve
    from aserve.profiles.profile_store import save_cost_model, save_token_budget

    cache = str(tmp_path)
    mine = CostModel(COST.tokens, COST.linear_s, COST.attn_prefill_s, COST.attn_decode_s, meta=identity())
    save_cost_model(cache, "default", "cpu", "auto", 1, mine)  # coupled x2 on 2 threads: 1 each

    def args(*flags):
        return build_parser().parse_args(["replay", "t.jsonl", "--cache-dir", cache, "--threads", "2",
                                          "--mode", "coupled", "--instances", "2", *flags])

    def budget(a, context=None):
        return engine_and_cluster(a, context)[0].max_num_batched_tokens

    a = args()
    assert engine_config(a).max_num_batched_tokens is None and cluster_config(a).chunk_size is None  # unset: no profiling
    want = mine.token_budget(mine.decode_slo_s(BUDGET_DECODE_BATCH, 1000), BUDGET_DECODE_BATCH, 1000)
    assert budget(a, context=1000) == want
    assert budget(args("--tbt-slo", "0.2"), context=1000) == mine.token_budget(0.2, BUDGET_DECODE_BATCH, 1000)
    # vllm's budget is the model's context length (read from the model's config, default cache)
    vllm = engine_config(build_parser().parse_args(["generate", "x", "--batching", "vllm"]))
    assert resolve(vllm)[0].max_num_batched_tokens == model_context(vllm) == 8192
    assert budget(args("--max-num-batched-tokens", "100")) == 100
    # (a context for the budget: without one it reads the model's window, which from this test's empty
    # cache folder would mean unpacking the model's file into it first)
    engine, cluster = engine_and_cluster(args(), 1000)
    assert cluster.chunk_size == mine.saturate_chunk() and resolve(engine, cluster) == (engine, cluster)
    assert engine_and_cluster(args("--chunk-size", "48"), 1000)[1].chunk_size == 48
    adaptive = engine_and_cluster(args("--mode", "adaptive", "--prefill", "1", "--decode", "1"), 1000)[1]
    assert adaptive.placement_step_s == mine.linear(1) and adaptive.placement_decode_row_s > 0
    assert cluster.placement_step_s == 0.01  # other modes never read them: the fixed defaults
    save_token_budget(cache, "default", "cpu", "auto", 1, 384)  # what 'profile token-budget' saved wins
    assert budget(args()) == 384
    with pytest.raises(ValueError, match="--tbt-slo must be > 0"):
        engine_config(args("--tbt-slo", "0"))


def test_measure_a_tiny_model():
    """A real measurement, on a tiny random model: every coefficient comes out, the checks ran."""
    from aserve.profiles.device_profile import CHECKS, GRID, PROFILE_VERSION, measure, num_points
    from tests.tiny import LLAMA, hf_model, ours

    config = {**LLAMA, "max_position_embeddings": 4096}  # the profile's longest context is 2,048
    model = ours(config, hf_model(config), torch.float32)
    seen = []
    cost = measure(model, torch.float32, "cpu", threads=1, reps=1, tick=seen.append, meta={"model": "tiny"})
    assert cost.tokens == GRID and all(t > 0 for t in cost.linear_s)
    assert cost.attn_prefill_s >= 0 and cost.attn_decode_s >= 0 and cost.contention >= 0 and cost.logits_row_s >= 0
    assert "logits" in seen  # the LM head timed on its own: what a prompt row that samples nothing saves
    if (os.cpu_count() or 1) >= 2:  # contention: the median of three alone / beside pairs, each kept
        pairs = cost.meta["contention_pairs"]
        assert len(pairs) == 3 and cost.contention == pytest.approx(max(0.0, sorted(pairs)[1]), abs=1e-4)
    assert [c["step"] for c in cost.meta["checks"]] == [c[0] for c in CHECKS]
    assert all(c["measured_s"] > 0 and c["predicted_s"] > 0 for c in cost.meta["checks"])
    assert cost.meta["model"] == "tiny" and cost.meta["threads"] == 1 and "cores" in cost.meta["machine"]
    assert cost.meta["version"] == PROFILE_VERSION
    assert len(seen) == len(GRID) + 1 + 3 + 4 + 1 + len(CHECKS) + 1 == num_points()  # the last: the probe again
    seen_at_rest = cost.meta["rest"]  # what measure() saw; measure_and_save adds the look before and the verdict
    assert seen_at_rest["probe_first_s"] == cost.linear_s[GRID.index(16)] and seen_at_rest["probe_last_s"] > 0
    assert seen_at_rest["others_cores_during"] is not None and seen_at_rest["others_cores_during"] >= 0
    assert isinstance(cost.meta["cpu_flags"], list)


def test_a_busy_machine_is_seen_and_profiling_refused_before_measuring(tmp_path):
    """Another process spinning a core: its CPU use is seen, and ``aserve profile device``
    refuses before it loads the model (nothing measured, nothing saved)."""
    import subprocess
    import sys

    from aserve.config import EngineConfig
    from aserve.profiles import rest
    from aserve.profiles.device_profile import measure_and_save
    from aserve.profiles.profile_store import device_profile_path

    spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: 0"])
    try:
        seen = rest.look(0.5)
        assert seen is not None and seen > 0.6, seen  # a whole core, less the interpreter's start
        with pytest.raises(ValueError, match=r"the machine is not at rest: other processes used \d\.\d\d cores before "
                                             r"the measurement .* Nothing measured\. .*--allow-busy"):
            measure_and_save(EngineConfig(cache_dir=str(tmp_path)), 1, quiet=True)
    finally:
        spin.kill()
        spin.wait()
    assert not device_profile_path(str(tmp_path)).exists()
