"""CUDA checks (skipped without a GPU): every attention backend matches the plain-torch
reference on the device, and the real model answers on CUDA."""
import pytest
import torch

from aserve.devices.runner import ModelRunner
from scheduling.step import SeqStep, StepPlan
from model.attention import flash_available
from model.kv_cache import KVCache
from model.loader import model_from_state_dict
from scheduling.block_manager import BlockManager
from tests.tiny import LLAMA, OPT, hf_model

pytestmark = pytest.mark.gpu


def cuda_runner(cfg, hf, backend, dtype=torch.float32, block_size=16):
    model = model_from_state_dict(cfg, hf.state_dict(), dtype, "cuda", backend)
    kv = KVCache(model.args, 128, block_size, dtype, "cuda")
    return ModelRunner(model, kv, "cuda"), BlockManager(128, block_size)


def mixed_step(blocks, lengths, cut):
    """Prefill the first ``cut`` tokens of each request, then one mixed step for the rest."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]
    tables = [blocks.allocate(-(-n // blocks.block_size)) for n in lengths]
    first = StepPlan(tuple(SeqStep(f"r{i}", tuple(s[:c]), 0, tuple(t)) for i, (s, t, c) in
                            enumerate(zip(seqs, tables, cut)) if c))
    second = StepPlan(tuple(SeqStep(f"r{i}", tuple(s[c:]), c, tuple(t)) for i, (s, t, c) in
                             enumerate(zip(seqs, tables, cut))))
    return first, second


def mixed_logits(cfg, hf, backend, dtype, block_size):
    """Logits of one mixed step (a fresh prompt, a continuation, two decodes) after a first."""
    runner, blocks = cuda_runner(cfg, hf, backend, dtype, block_size)
    first, second = mixed_step(blocks, [40, 17, 33, 9], [0, 16, 32, 8])
    runner.forward_logits(first)
    return runner.forward_logits(second).float().cpu()


@pytest.mark.parametrize("cfg", [LLAMA, OPT], ids=["llama", "opt"])
def test_sdpa_matches_reference_on_cuda(cfg):
    hf = hf_model(cfg)
    want = mixed_logits(cfg, hf, "reference", torch.float32, 16)
    assert (want - mixed_logits(cfg, hf, "sdpa", torch.float32, 16)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("cfg", [LLAMA, OPT], ids=["llama", "opt"])
@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_bf16_backend_matches_fp32_reference_on_cuda(cfg, backend):
    """In bf16, as flash-attn runs (it takes no fp32), with blocks of 256 tokens (its paged kernel
    takes no others): relative error against the fp32 reference within bf16's band, and no worse
    than the bf16 reference's own."""
    if backend == "flash" and not flash_available():
        pytest.skip("flash_attn is not installed on this machine")
    hf = hf_model(cfg)
    want = mixed_logits(cfg, hf, "reference", torch.float32, 256)
    ref16 = mixed_logits(cfg, hf, "reference", torch.bfloat16, 256)
    got = mixed_logits(cfg, hf, backend, torch.bfloat16, 256)
    err = ((got - want).norm() / want.norm()).item()
    assert err <= 2e-2
    assert err <= 2 * ((ref16 - want).norm() / want.norm()).item() + 1e-3


def test_flash_refuses_blocks_and_dtypes_its_kernel_cannot_read():
    from model.attention import pick_backend

    if not flash_available():
        pytest.skip("flash_attn is not installed on this machine")
    with pytest.raises(ValueError, match="--block-size 256"):
        pick_backend("flash", "cuda", block_size=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="--dtype bf16"):
        pick_backend("flash", "cuda", block_size=256, dtype=torch.float32)
    assert pick_backend("auto", "cuda", block_size=16, dtype=torch.bfloat16) == "sdpa"
    assert pick_backend("auto", "cuda", block_size=256, dtype=torch.bfloat16) == "flash"


def test_cuda_matches_transformers_cpu():
    hf = hf_model(LLAMA)
    runner, blocks = cuda_runner(LLAMA, hf, "sdpa")
    ids = list(range(3, 50))
    b = blocks.allocate(3)
    got = runner.forward_logits(StepPlan((SeqStep("r", tuple(ids), 0, tuple(b)),))).cpu()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_default_model_on_cuda_says_paris():
    from aserve.config import EngineConfig
    from aserve.engine.offline import LLM
    from scheduling.request import SamplingParams

    llm = LLM(EngineConfig(device="cuda", dtype="bf16", kv_cache_gb=0.5))
    out = llm.generate(["What is the capital of France?"], SamplingParams(max_tokens=16, temperature=0), chat=True)
    assert "Paris" in out[0].text
