"""CUDA checks (skipped without a GPU): every attention backend matches the plain-torch
reference on the device, and the real model answers on CUDA."""
import pytest
import torch

from aserve.engine.runner import ModelRunner
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


@pytest.mark.parametrize("cfg", [LLAMA, OPT], ids=["llama", "opt"])
@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_backend_matches_reference_on_cuda(cfg, backend):
    if backend == "flash" and not flash_available():
        pytest.skip("flash_attn is not installed")
    hf = hf_model(cfg)
    lengths, cut = [40, 17, 33, 9], [0, 16, 32, 8]  # one fresh prompt, one continuation, two decodes
    outs = {}
    for name in ("reference", backend):
        runner, blocks = cuda_runner(cfg, hf, name, block_size=256 if backend == "flash" else 16)
        first, second = mixed_step(blocks, lengths, cut)
        runner.forward_logits(first)
        outs[name] = runner.forward_logits(second).cpu()
    assert (outs["reference"] - outs[backend]).abs().max().item() <= 1e-4


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
