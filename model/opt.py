"""The OPT family: learned positions (offset 2), LayerNorm before or after each sub-block,
ReLU FFN, biases everywhere, and ``project_in/out`` when the embedding is narrower than the
hidden size (OPT-350M)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import AttentionMeta, paged_attention, write_kv
from model.config import ModelArgs
from model.layers import Linear
from model.llama import _load_exact
from model import native

POSITION_OFFSET = 2  # OPT's learned position table starts at index 2 (fairseq legacy)


class OPTAttention(nn.Module):
    def __init__(self, args: ModelArgs, backend: str):
        super().__init__()
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        size = args.hidden_size
        self.qkv_proj = Linear(size, 3 * size, bias=args.attention_bias)
        self.out_proj = Linear(size, size, bias=args.attention_bias)
        self.scale = args.head_dim ** -0.5
        self.backend = backend

    def forward(self, x, meta: AttentionMeta, kv: torch.Tensor):
        t = x.shape[0]
        q, k, v = (z.view(t, self.num_heads, self.head_dim) for z in self.qkv_proj(x).chunk(3, dim=-1))
        write_kv(kv[0], kv[1], k, v, meta)
        out = paged_attention(q, kv[0], kv[1], meta, self.scale, self.backend)
        return self.out_proj(out.reshape(t, -1))


class OPTBlock(nn.Module):
    def __init__(self, args: ModelArgs, backend: str):
        super().__init__()
        self.pre_norm = args.do_layer_norm_before
        self.attn_norm = nn.LayerNorm(args.hidden_size)
        self.attn = OPTAttention(args, backend)
        self.ffn_norm = nn.LayerNorm(args.hidden_size)
        self.fc1 = Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.fc2 = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.act = F.relu if args.activation == "relu" else F.gelu

    def forward(self, x, meta, kv):
        if self.pre_norm:
            h = x + self.attn(self.attn_norm(x), meta, kv)
            return h + self.fc2(self.act(self.fc1(self.ffn_norm(h))))
        h = self.attn_norm(x + self.attn(x, meta, kv))
        return self.ffn_norm(h + self.fc2(self.act(self.fc1(h))))


class OPTForCausalLM(nn.Module):
    native = True  # the LM head through our packed product where it applies (native.use_kernels)

    def __init__(self, args: ModelArgs, backend: str = "sdpa", final_norm: bool = True):
        super().__init__()
        self.args = args
        emb_dim = args.word_embed_proj_dim or args.hidden_size
        self.embed = nn.Embedding(args.vocab_size, emb_dim)
        self.embed_positions = nn.Embedding(args.max_position + POSITION_OFFSET, args.hidden_size)
        self.project_in = Linear(emb_dim, args.hidden_size, bias=False) if args.word_embed_proj_dim else None
        self.project_out = Linear(args.hidden_size, emb_dim, bias=False) if args.word_embed_proj_dim else None
        self.layers = nn.ModuleList(OPTBlock(args, backend) for _ in range(args.num_layers))
        # OPT-350M (post-norm) has no final LayerNorm
        self.final_norm = nn.LayerNorm(args.hidden_size) if args.do_layer_norm_before and final_norm else None
        self.lm_head = None if args.tie_embeddings else Linear(emb_dim, args.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMeta, kv: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for i, layer in enumerate(self.layers):
            x = layer(x, meta, kv[i])
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        return native.logits(hidden, self.embed.weight if self.lm_head is None else self.lm_head.weight, self.native)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in HF's ``OPTForCausalLM`` (``model.decoder.*``), fusing q/k/v."""
        sd = {k.removeprefix("model.").removeprefix("decoder."): v for k, v in sd.items()}
        own = {"embed.weight": sd["embed_tokens.weight"], "embed_positions.weight": sd["embed_positions.weight"]}
        for name in ("project_in", "project_out"):
            if getattr(self, name) is not None:
                own[f"{name}.weight"] = sd[f"{name}.weight"]
        if self.final_norm is not None:
            own.update({f"final_norm.{s}": sd[f"final_layer_norm.{s}"] for s in ("weight", "bias")})
        if self.lm_head is not None:
            own["lm_head.weight"] = sd.get("lm_head.weight", sd["embed_tokens.weight"])
        for i in range(self.args.num_layers):
            p, o = f"layers.{i}.", f"layers.{i}."
            for s in ("weight", "bias"):
                own[f"{o}attn.qkv_proj.{s}"] = torch.cat([sd[f"{p}self_attn.{n}_proj.{s}"] for n in "qkv"])
                own[f"{o}attn.out_proj.{s}"] = sd[f"{p}self_attn.out_proj.{s}"]
                own[f"{o}attn_norm.{s}"] = sd[f"{p}self_attn_layer_norm.{s}"]
                own[f"{o}ffn_norm.{s}"] = sd[f"{p}final_layer_norm.{s}"]
                own[f"{o}fc1.{s}"] = sd[f"{p}fc1.{s}"]
                own[f"{o}fc2.{s}"] = sd[f"{p}fc2.{s}"]
        _load_exact(self, own)
