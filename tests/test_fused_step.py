"""The fused decode step (model/fused_step.py) against torch's eager step.

On the CPU its Triton kernels run in Triton's interpreter (set before they load): the same
kernels a card compiles, so the layout, masks, splits and rounding are checked here; the ``gpu``
test replays them captured on a card."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # interpreted here; compiled for the card where there is one
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when model.fused_kernels loads

pytest.importorskip("triton")

from tests.test_cuda_graphs import run_both, runners  # noqa: E402

# head dim 32 (the smallest the fused step takes), 3 query heads a KV head, hidden 96 (not a
# multiple of the 128-column tile), intermediate 80 (not a multiple of the 16-column one)
CFG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=200, hidden_size=96,
           intermediate_size=80, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
           max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=True)


def fused_runners(device="cpu", replay=False, max_batch=8, num_blocks=96):
    plain, graphed = runners(CFG, backend="sdpa", dtype=torch.bfloat16, device=device, replay=replay,
                             max_batch=max_batch, num_blocks=num_blocks)
    assert graphed.graphs.fused is not None, graphed.graphs.fused_refusal
    return plain, graphed


def close(outs, tol=0.06):
    """bf16 logits of magnitude ~1: a fused step sums in another order (and keeps fp32 logits)."""
    worst = max((a - b).abs().max().item() for a, b in zip(outs["plain"], outs["graphed"]))
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("lengths", [[5], [40, 17, 3], [300, 9, 130, 2, 66]], ids=["1", "3", "5"])
def test_fused_step_matches_the_eager_step(lengths):
    """1 row; 3 rows padded to 4; 5 rows padded to 8 over contexts from 3 tokens to 303, which
    split a row's context over up to 5 attention programs (64 tokens each)."""
    plain, graphed = fused_runners()
    outs, _ = run_both(plain, graphed, lengths)
    close(outs)
    assert graphed.graphs.num_replays == 3


def test_fused_step_splits_a_long_context_over_several_tiles_a_split():
    """1,100 tokens: 18 tiles of 64 in 8 splits, three tiles to most of them."""
    plain, graphed = fused_runners(num_blocks=96)
    splits, per_split = graphed.graphs.fused.splits(128)  # the 2,048-token bucket a 1,100 context takes
    assert (splits, per_split) == (8, 4)
    outs, _ = run_both(plain, graphed, [1100, 7], decode_steps=2)
    close(outs)


def test_fused_step_writes_each_rows_kv_and_pads_write_only_the_scratch_block():
    plain, graphed = fused_runners()
    _, tables = run_both(plain, graphed, [40, 17, 3])
    n = plain.kv.num_blocks
    used = sorted(b for t in tables for b in t)
    assert (graphed.kv.pool[:, :, used].float() - plain.kv.pool[:, :, used].float()).abs().max().item() <= 0.05
    unused = sorted(set(range(n)) - set(used))
    assert torch.count_nonzero(graphed.kv.pool[:, :, unused]) == 0  # no other request's block
    assert torch.count_nonzero(graphed.kv.pool[:, :, n]) > 0  # the pad rows wrote to the scratch block


def test_a_wrong_step_is_caught():
    """The comparison above can fail: the fused step given the last layer's down weight tripled
    (a copy: the model is the plain runner's too) is told apart."""
    plain, graphed = fused_runners()
    fused = graphed.graphs.fused
    *rest, down = fused.layers[-1]
    fused.layers[-1] = (*rest, down * 3)
    try:
        outs, _ = run_both(plain, graphed, [12], decode_steps=1)
    except AssertionError:  # the greedy tokens differ already
        return
    with pytest.raises(AssertionError):
        close(outs)


def test_a_step_triton_cannot_build_falls_back_to_torchs_step(monkeypatch):
    """A kernel that fails to build (an older card) turns the fused step off with the reason in
    the start-up line; the graphs then take torch's step, which matches the plain runner."""
    from model import fused_kernels

    plain, graphed = fused_runners()

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("PassManager::run failed\n(the compiler's long log)")

    monkeypatch.setattr(fused_kernels, "gate_up_kernel", Broken())
    graphed.graphs.check_fused([(1, 4)])
    assert graphed.graphs.fused is None
    assert graphed.graphs.fused_refusal == ("off: Triton could not build it here "
                                            "(RuntimeError: PassManager::run failed)")
    outs, _ = run_both(plain, graphed, [12, 30])
    for a, b in zip(outs["plain"], outs["graphed"]):
        assert torch.equal(a, b)  # torch's step both sides


def test_refusals_name_the_reason():
    from model import fused_step
    from tests.tiny import LLAMA, OPT, hf_model, ours

    llama = ours(LLAMA, hf_model(LLAMA), torch.bfloat16)
    assert "power of two from 32" in fused_step.refusal(llama, torch.bfloat16, "cpu")  # head dim 16
    assert "bf16 or fp16" in fused_step.refusal(ours(CFG, hf_model(CFG)), torch.float32, "cpu")
    assert "LLaMA family" in fused_step.refusal(ours(OPT, hf_model(OPT), torch.bfloat16), torch.bfloat16, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[5], [40, 17, 3], [300, 9, 130, 2, 66]], ids=["1", "3", "5"])
def test_fused_step_replayed_on_cuda_matches_the_eager_step(lengths):
    plain, graphed = fused_runners(device="cuda", replay=True)
    outs, _ = run_both(plain, graphed, lengths)
    close(outs)
    assert graphed.graphs.num_replays == 3
