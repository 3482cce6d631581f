"""The interference study's iterations on a tiny random model: every figure is there, each
iteration really computes (more tokens take longer), and every block is given back."""
import pytest
import torch

from aserve.bench.interference import _Steps, measure, run_interference_bench
from aserve.config import EngineConfig
from tests.tiny import LLAMA, hf_model, make_runner, ours


def test_measure_returns_every_figure_and_frees_blocks():
    torch.manual_seed(0)
    runner, blocks = make_runner(ours(LLAMA, hf_model(LLAMA)), num_blocks=2048)
    r = measure(_Steps(runner, blocks, "cpu", reps=1), light=16, heavy=256, decode_batch=4, heavy_context=512)
    p = r["prefill_beside_prefill"]
    assert set(p["slowdowns"]) == {"light_with_7_light", "light_with_63_light", "light_with_1_heavy",
                                   "light_with_3_heavy"}
    assert p["light_with_63_light_s"] > p["light_alone_s"]  # 64x the tokens in one iteration
    d = r["decode_beside_prefill"]
    assert d["slowdown"] == pytest.approx(d["step_with_heavy_prefill_s"] / d["step_alone_s"])
    m = r["decode_beside_decode"]
    assert m["all_light_tokens_per_s"] > 0 and m["half_heavy_tokens_per_s"] > 0
    assert blocks.num_free == blocks.num_blocks


def test_bad_sizes_name_the_flag():
    with pytest.raises(ValueError, match="--decode-batch must be >= 1"):
        run_interference_bench(EngineConfig(), decode_batch=0)
    with pytest.raises(ValueError, match="must exceed --light"):
        run_interference_bench(EngineConfig(), light=512, heavy=256)
