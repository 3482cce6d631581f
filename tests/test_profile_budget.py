"""``aserve profile token-budget``: the choice rule and the search on injected timings, one real
short run on a tiny random model, the saved budget as the sarathi default, the CLI's errors."""
from __future__ import annotations

import math

import pytest
import torch

from aserve.bench.token_budget import BudgetProfile, NoBudgetMeetsSLO, Timing, pick_budget, profile_token_budget, search
from tests.tiny import LLAMA, hf_model, ours


# ---- the choice rule --------------------------------------------------------------------------------
def test_monotone_times_pick_the_largest_budget_under_the_slo():
    medians = {64: 0.010, 128: 0.020, 256: 0.040, 512: 0.080}
    assert pick_budget(medians, 0.05, 64) == 256
    assert pick_budget(medians, 0.08, 64) == 512  # exactly the SLO meets it
    assert pick_budget(medians, 1.0, 64) == 512


def test_non_monotone_times_stop_at_the_first_miss():
    # 256 measured under the SLO after 128 missed it: every size up to the budget must meet it
    assert pick_budget({64: 0.01, 128: 0.06, 256: 0.04}, 0.05, 64) == 64
    assert pick_budget({256: 0.04, 64: 0.01, 128: 0.03}, 0.05, 64) == 256  # order of the dict is irrelevant


def test_choice_is_rounded_down_to_the_tile():
    assert pick_budget({64: 0.01, 100: 0.02, 200: 0.03, 300: 0.09}, 0.05, 64) == 192
    assert pick_budget({64: 0.01, 200: 0.03}, 0.05, 50) == 200
    with pytest.raises(NoBudgetMeetsSLO, match="less than one --tile of 64"):
        pick_budget({32: 0.01, 64: 0.09}, 0.05, 64)


def test_no_budget_meets_the_slo_names_the_smallest_and_its_time():
    with pytest.raises(NoBudgetMeetsSLO, match=r"the smallest, 64 tokens, takes 100\.0 ms"):
        pick_budget({128: 0.2, 64: 0.1}, 0.05, 64)
    with pytest.raises(ValueError, match="no budget was measured"):
        pick_budget({}, 0.05, 64)


def test_timing_median_and_nearest_rank_p90():
    t = Timing(64, (0.3, 0.1, 0.2))
    assert t.median_s == 0.2 and t.p90_s == 0.3
    assert Timing(64, tuple(i / 10 for i in range(1, 11))).p90_s == 0.9


# ---- the search with an injected timing function ---------------------------------------------------------
class FakeEngine:
    """Iteration seconds as a function of the budget; records what was measured."""

    def __init__(self, seconds):
        self.seconds, self.measured = seconds, []

    def __call__(self, budget: int) -> list[float]:
        self.measured.append(budget)
        return [self.seconds(budget)] * 3


def test_search_sweeps_then_bisects_over_tiles():
    engine = FakeEngine(lambda b: 0.010 + b * 1e-5)  # meets 20 ms up to 1000 tokens
    prof = BudgetProfile(0.020, decode_batch=32, tile=64, max_budget=4096)
    timings = search(engine, prof)
    assert engine.measured == [64, 128, 256, 512, 1024, 768, 896, 960]  # never 2048 or 4096
    assert list(timings) == sorted(engine.measured)
    assert pick_budget({b: t.median_s for b, t in timings.items()}, prof.tbt_slo_s, prof.tile) == 960


def test_search_on_noisy_times_bisects_below_the_first_miss():
    noisy = {64: 0.01, 128: 0.02, 192: 0.06, 256: 0.07, 512: 0.03}
    engine = FakeEngine(lambda b: noisy[b])
    timings = search(engine, BudgetProfile(0.05, decode_batch=8, tile=64, max_budget=512))
    assert engine.measured == [64, 128, 256, 192]  # 512 is never tried after 256 missed
    assert pick_budget({b: t.median_s for b, t in timings.items()}, 0.05, 64) == 128


def test_search_when_everything_meets_the_slo_measures_every_candidate():
    engine = FakeEngine(lambda b: 0.001)
    search(engine, BudgetProfile(1.0, decode_batch=100, tile=64, max_budget=1024))
    assert engine.measured == [128, 256, 512, 1024]  # 64 cannot hold 100 decodes


@pytest.mark.parametrize("field, kwargs", [
    ("--tbt-slo", dict(tbt_slo_s=0)), ("--tbt-slo", dict(tbt_slo_s=-1.0)), ("--tbt-slo", dict(tbt_slo_s=math.nan)),
    ("--decode-batch", dict(tbt_slo_s=1, decode_batch=0)), ("--tile", dict(tbt_slo_s=1, tile=0)),
    ("--repeats", dict(tbt_slo_s=1, repeats=0)), ("--max-budget", dict(tbt_slo_s=1, decode_batch=64, max_budget=32)),
])
def test_bad_profile_settings_name_the_flag(field, kwargs):
    with pytest.raises(ValueError, match=field):
        BudgetProfile(**kwargs)


# ---- a real short run on a tiny random model -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    return ours(LLAMA, hf_model(LLAMA))


def test_real_run_on_a_tiny_model(tiny_model):
    prof = BudgetProfile(10.0, decode_batch=4, context=32, tile=16, max_budget=128, repeats=2)
    timings = profile_token_budget(tiny_model, torch.float32, "cpu", prof)
    assert list(timings) == [16, 32, 64, 128]  # a 10 s SLO: the whole sweep, nothing to bisect
    assert all(len(t.seconds) == 2 and min(t.seconds) > 0 for t in timings.values())
    budget = pick_budget({b: t.median_s for b, t in timings.items()}, prof.tbt_slo_s, prof.tile)
    assert budget == 128 and timings[budget].median_s <= prof.tbt_slo_s
    tight = BudgetProfile(1e-9, decode_batch=4, context=32, tile=16, max_budget=128, repeats=1)
    few = profile_token_budget(tiny_model, torch.float32, "cpu", tight)
    assert list(few) == [16]  # the first candidate already misses: the sweep stops
    with pytest.raises(NoBudgetMeetsSLO, match="the smallest, 16 tokens, takes"):
        pick_budget({b: t.median_s for b, t in few.items()}, tight.tbt_slo_s, tight.tile)


# ---- the saved budget and the command line ----------------------------------------------------------------
def test_saved_budget_is_the_sarathi_default(tmp_path):
    from aserve.commands import build_parser
    from aserve.commands.common import engine_config
    from aserve.devices.measured import resolve
    from aserve.profiles.cost_model import CostModel
    from aserve.profiles.device_profile import identity
    from aserve.profiles.profile_store import save_cost_model, save_token_budget, token_budget

    cache = str(tmp_path)
    save_token_budget(cache, "default", "cpu", "auto", 7, 384)
    save_token_budget(cache, "default", "cpu", "auto", 3, 256)  # another key does not erase it
    assert token_budget(cache, "default", "cpu", "auto", 7) == 384 and token_budget(cache, "default", "cpu", "auto", 3) == 256
    base = ["bench", "swap-int8", "--cache-dir", cache, "--threads"]

    def budget(*flags: str) -> int:
        engine = engine_config(build_parser().parse_args(base + list(flags)), context=512)
        return resolve(engine)[0].max_num_batched_tokens  # the start-up step that measures what is unset

    assert budget("7") == 384
    assert budget("7", "--batching", "alise") == 384  # alise chunks within the same budget
    assert budget("7", "--max-num-batched-tokens", "100") == 100  # the user's value wins
    # 5 threads were not profiled for a budget: derived from the measured engine's step costs
    cost = CostModel((1, 1024), (0.01, 0.5), 1e-9, 5e-8, meta=identity())
    save_cost_model(cache, "default", "cpu", "auto", 5, cost)
    assert budget("5") == cost.token_budget(cost.decode_slo_s(32, 512), 32, 512)


def test_cli_refuses_a_non_positive_slo(capsys):
    from aserve.commands import EXIT_USAGE, main

    assert main(["profile", "token-budget", "--tbt-slo", "0"]) == EXIT_USAGE
    assert "--tbt-slo must be > 0" in capsys.readouterr().err
