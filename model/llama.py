"""The LLaMA family (LLaMA 2/3, SmolLM2, ...): RMSNorm, RoPE, grouped-query attention, SwiGLU.

Q/K/V and gate/up projections are fused into one matmul each at load time: on a CPU the
per-op overhead of a small model is a real share of a decode step.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import AttentionMeta, paged_attention, write_kv
from model.config import ModelArgs
from model.layers import Linear, RMSNorm, RotaryEmbedding, apply_rope
from model import native


class LlamaAttention(nn.Module):
    native = True  # fp32 RoPE through our kernel where it applies (native.use_kernels)

    def __init__(self, args: ModelArgs, backend: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=args.attention_bias)
        self.scale = args.head_dim ** -0.5
        self.backend = backend

    def forward(self, x, rope: tuple, meta: AttentionMeta, kv: torch.Tensor):
        # x: [T, hidden]; kv: [2, num_blocks, block_size, H_kv, D] (this layer's slice of the pool)
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = apply_rope(qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), *rope, native_ok=self.native)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, H_kv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        write_kv(kv[0], kv[1], k, v, meta)
        out = paged_attention(q, kv[0], kv[1], meta, self.scale, self.backend)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    native = True  # SwiGLU in our product's epilogue where it applies (native.use_kernels)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x):
        if self.gate_up_proj.bias is None:  # one packed product with SwiGLU in its epilogue (bf16 CPU)
            return self.down_proj(native.silu_mul(x, self.gate_up_proj.weight, self.native))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    def __init__(self, args: ModelArgs, backend: str):
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.attn = LlamaAttention(args, backend)
        self.mlp_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = LlamaMLP(args)

    def forward(self, x, rope, meta, kv):
        h = x + self.attn(self.attn_norm(x), rope, meta, kv)
        return h + self.mlp(self.mlp_norm(h))


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids, positions, meta, kv) -> hidden [T, hidden]``; ``logits(hidden)``."""

    native = True  # the LM head through our packed product where it applies (native.use_kernels)
    native_step = True  # a bf16 step in one native.llama_forward call where it applies

    def __init__(self, args: ModelArgs, backend: str = "sdpa"):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.rope = RotaryEmbedding(args.head_dim, args.max_position, args.rope_theta)
        self.layers = nn.ModuleList(LlamaBlock(args, backend) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.lm_head = None if args.tie_embeddings else Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMeta, kv: torch.Tensor) -> torch.Tensor:
        # kv: the pool [L, 2, num_blocks, block_size, H_kv, D]
        return self.forward_tapped(input_ids, positions, meta, kv)[0]

    def forward_tapped(self, input_ids, positions, meta: AttentionMeta, kv: torch.Tensor, tap_layer: int = 0,
                       tap_rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``forward``, and ``tap_rows``' hidden states after ``tap_layer`` layers through the final
        norm ([R, hidden]: what the first ``tap_layer`` layers as a model of their own output, the
        ``lm`` length predictor's features; None when no tap is asked)."""
        if tap_layer and not 0 < tap_layer <= len(self.layers):
            raise ValueError(f"tap_layer must be in 1..{len(self.layers)}, got {tap_layer}")
        x = self.embed(input_ids)  # [T, hidden]
        if self._native_step(x, meta):
            cos, sin = self.rope.cos[positions].float(), self.rope.sin[positions].float()
            hidden, taps = native.llama_forward(x, cos, sin, self._step_weights(), self.norm.weight, kv,
                                                meta, self.args.num_heads, self.args.norm_eps,
                                                self.layers[0].attn.scale, tap_layer, tap_rows,
                                                widen=self._widen(x.shape[0]))
            return hidden, taps if tap_layer else None
        rope = self.rope.tables(positions, x.dtype)
        taps = None
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, meta, kv[i])
            if i + 1 == tap_layer:
                taps = self.norm(x[tap_rows])
        return self.norm(x), taps

    def _native_step(self, x: torch.Tensor, meta: AttentionMeta) -> bool:
        """Whether this step can run as one ``native.llama_forward`` call: kernels ``native``, the
        native attention backend, bf16 on a CPU with the packed products and a head layout the
        attention kernels take, no biases, no autograd. Any mix of prompt chunks, decode tokens
        and pad rows."""
        return (self.native_step and x.dtype is torch.bfloat16 and x.device.type == "cpu"
                and self.layers[0].attn.backend == "native" and not (self.args.attention_bias or self.args.mlp_bias)
                and not torch.is_grad_enabled() and self.norm.weight.dtype is torch.bfloat16 and native.packable(x, self.embed.weight)
                and self.args.intermediate_size % 32 == 0
                and (not meta.prefills or (self.args.head_dim in (32, 64, 128)  # paged_prefill's layouts
                                           and self.args.num_heads // self.args.num_kv_heads <= 8)))

    def _step_weights(self) -> list:
        """The six weights of each layer in ``llama_forward``'s order, the four matrices packed
        (``native.step_weights``). Packed once; a weight changed in place or moved since (its
        version counter or data pointer) has the list rebuilt. The check reads two attributes a
        weight: ``native.packed`` for each of the 121 matrices took 0.2 ms of a 10 ms step."""
        if getattr(self, "_step_params", None) is None:
            self._step_params = [w for b in self.layers for w in (
                b.attn_norm.weight, b.attn.qkv_proj.weight, b.attn.o_proj.weight, b.mlp_norm.weight,
                b.mlp.gate_up_proj.weight, b.mlp.down_proj.weight)]
            self._step_key, self._step_packed = None, None
        key = [(p._version, p.data_ptr()) for p in self._step_params]
        if key != self._step_key:
            self._step_packed, self._step_key = native.step_weights(self._step_params), key
        return self._step_packed

    def _widen(self, rows: int) -> bool:
        """Whether a product of ``rows`` rows widens its bf16 weights to fp32 FMAs (from
        ``native.wide_rows`` rows, measured on this model's layer shapes at the caller's thread
        count, once a process) instead of taking bf16 dot products."""
        if getattr(self, "_layer_shapes", None) is None:  # read once (packing them here would refuse
            b = self.layers[0]  # a gate_up of rows not a multiple of 64, which the packed step never takes)
            self._layer_shapes = tuple(tuple(w.shape) for w in (b.attn.qkv_proj.weight, b.attn.o_proj.weight,
                                                                b.mlp.gate_up_proj.weight, b.mlp.down_proj.weight))
        wide_from = native.wide_rows(self._layer_shapes, torch.get_num_threads())
        return bool(wide_from) and rows >= wide_from

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab], widened as a step's layers are from
        as many rows (``_widen``)."""
        native_head = self.native and native.packable(hidden, self.embed.weight)
        return native.logits(hidden, self.embed.weight if self.lm_head is None else self.lm_head.weight, self.native,
                             widen=native_head and self._widen(hidden.shape[0]))

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in HF's ``LlamaForCausalLM``, fusing q/k/v and gate/up."""
        own = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
        if self.lm_head is not None:
            own["lm_head.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        for i in range(self.args.num_layers):
            p, o = f"model.layers.{i}.", f"layers.{i}."
            for suffix in ("weight", "bias"):
                parts = [sd.get(f"{p}self_attn.{n}_proj.{suffix}") for n in "qkv"]
                if parts[0] is not None:
                    own[f"{o}attn.qkv_proj.{suffix}"] = torch.cat(parts)
                    own[f"{o}attn.o_proj.{suffix}"] = sd[f"{p}self_attn.o_proj.{suffix}"]
                gate = sd.get(f"{p}mlp.gate_proj.{suffix}")
                if gate is not None:
                    own[f"{o}mlp.gate_up_proj.{suffix}"] = torch.cat([gate, sd[f"{p}mlp.up_proj.{suffix}"]])
                    own[f"{o}mlp.down_proj.{suffix}"] = sd[f"{p}mlp.down_proj.{suffix}"]
            own[f"{o}attn_norm.weight"] = sd[f"{p}input_layernorm.weight"]
            own[f"{o}mlp_norm.weight"] = sd[f"{p}post_attention_layernorm.weight"]
        _load_exact(self, own)


def _load_exact(module: nn.Module, own: dict[str, torch.Tensor]) -> None:
    """Load a full state dict; every parameter must be given (buffers are rebuilt, not loaded)."""
    missing, unexpected = module.load_state_dict(own, strict=False)
    missing = [m for m in missing if m in dict(module.named_parameters())]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
