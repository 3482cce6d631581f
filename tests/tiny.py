"""Tiny random models of both families, built by transformers and copied into ours."""
from __future__ import annotations

import torch

from aserve.devices.runner import ModelRunner
from scheduling.step import SeqStep, StepPlan
from model.config import ModelArgs
from model.kv_cache import KVCache
from model.loader import model_from_state_dict
from scheduling.block_manager import BlockManager

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False)
OPT = dict(model_type="opt", architectures=["OPTForCausalLM"], vocab_size=128, hidden_size=64, ffn_dim=96,
           num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=1024, do_layer_norm_before=True,
           word_embed_proj_dim=64, activation_function="relu", enable_bias=True)


def hf_model(cfg: dict, seed: int = 0):
    """transformers' own model on random weights (float32, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    conf = AutoConfig.for_model(**cfg)
    conf._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(conf).eval()
    with torch.no_grad():  # make biases and norms non-trivial so parity means something
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ours(cfg: dict, hf, dtype=torch.float32, backend="reference"):
    return model_from_state_dict(cfg, hf.state_dict(), dtype, "cpu", backend)


def make_runner(model, num_blocks: int = 256, block_size: int = 16):
    args: ModelArgs = model.args
    dtype = next(model.parameters()).dtype
    kv = KVCache(args, num_blocks, block_size, dtype, "cpu")
    return ModelRunner(model, kv, "cpu"), BlockManager(num_blocks, block_size)


def prefill_logits(runner, blocks, ids: list[int], chunk: int, block_ids: list[int]) -> torch.Tensor:
    """Feed ``ids`` in chunks of ``chunk`` tokens; returns every token's logits [len(ids), vocab]."""
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        blocks.grow(block_ids, start + len(piece))
        step = StepPlan((SeqStep("r", tuple(piece), start, tuple(block_ids)),))
        out.append(runner.forward_logits(step))
    return torch.cat(out)
