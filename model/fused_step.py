"""A LLaMA decode step of a few rows in five Triton kernels a layer, for CUDA graphs.

Replayed as a CUDA graph, torch's eager decode step of the default model is 830 kernels (about
27 a layer: the norm's casts, the rotary halves, the gathers of the paged cache, the mask, SwiGLU's
three ops, each residual add), and at about 2 us each on an H200 its time is theirs, not the
weights' (docs/notes/cuda.md). This step is 2 + 5 L kernels (152 for SmolLM2-135M's 30 layers):

    embed                      res = embed[ids]
    per layer:
      qkv_rope                 norm, the fused q/k/v product, RoPE, K/V written at each row's slot
      attention                each (row, KV head) over up to MAX_SPLITS splits of its context,
                               read in place through the block table (flash-decoding's split)
      oproj                    the splits combined, the output product, the residual add
      gate_up                  norm, the gate and up products, SwiGLU
      down                     the down product, the residual add
    head                       the final norm and the LM head (fp32 logits)

It reads ``DecodeGraphs``' static buffer (token ids, positions, slots, context lengths, block
tables) and writes its own static buffers, so a graph captured over it replays it as is. It
applies to the LLaMA family without biases in bf16 or fp16, for up to ``MAX_BATCH`` rows (larger
decode batches replay torch's step, whose products are already matrix products); ``refusal``
says why elsewhere. On the CPU the kernels run through Triton's interpreter (the tests).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

MAX_BATCH = 16  # rows: the products' row tile (tl.dot's smallest)
MAX_SPLITS = 8  # attention programs a (row, KV head) splits its context over
TILE = 64  # context tokens an attention program reads at once
# Tiles as timed on an H200 (benchmarks/fused_step.py --sweep; docs/notes/cuda.md, 2026-11-30).
# The 16-row path (tl.dot):
BK = 256  # columns of a weight a product reads at once
BN = 16  # output columns of a product program (tl.dot's smallest)
HEAD_BN = 64  # LM head columns a program
NUM_WARPS = 4
# Batches of up to ROW_FMA rows multiply their own rows by FMAs (no 16-row tile), with narrower
# programs: more of them, each a shorter chain of loads
ROW_FMA = 2
BK_FMA = 512
BN_FMA = 8
HB_FMA = 8  # q/k/v dims a program (of each half a head)
HEAD_BN_FMA = 16  # (0.80 ms a batch-1 step against 0.87 at 32, 1.01 at 64)
NUM_WARPS_FMA = 4


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def refusal(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why a fused step cannot run ``model`` on ``device`` (None where it can)."""
    from model.llama import LlamaForCausalLM

    if not available():
        return "Triton is not installed"
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the fused step runs on CUDA (or in Triton's interpreter: TRITON_INTERPRET=1)"
    if not isinstance(model, LlamaForCausalLM):
        return f"the fused step is the LLaMA family's; this model is {model.args.family}"
    a = model.args
    if a.attention_bias or a.mlp_bias:
        return "the fused step has no biases"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the fused step runs in bf16 or fp16, not {str(dtype).removeprefix('torch.')}"
    if a.head_dim < 32 or a.head_dim & (a.head_dim - 1):
        return f"the fused step needs a head dim that is a power of two from 32, got {a.head_dim}"
    if a.num_heads // a.num_kv_heads > 64:
        return f"the fused step takes at most 64 query heads a KV head, got {a.num_heads // a.num_kv_heads}"
    return None


class FusedStep:
    """The fused decode step of ``model`` over one KV pool, with its static buffers for up to
    ``max_batch`` rows (at most ``MAX_BATCH``)."""

    def __init__(self, model: torch.nn.Module, pool: torch.Tensor, block_size: int, max_batch: int = MAX_BATCH):
        why = refusal(model, pool.dtype, pool.device)
        if why:
            raise ValueError(why)
        from model import fused_kernels  # Triton loads here, not at import

        self.k = fused_kernels
        self.model, self.pool, self.block_size = model, pool, block_size
        a = self.args = model.args
        self.max_batch = min(max_batch, MAX_BATCH)
        dev, dt = pool.device, pool.dtype
        self.group = a.num_heads // a.num_kv_heads
        self.group_tile = max(16, 1 << (self.group - 1).bit_length())
        self.res = torch.zeros(MAX_BATCH, a.hidden_size, dtype=dt, device=dev)
        self.q = torch.zeros(MAX_BATCH, a.num_heads, a.head_dim, dtype=dt, device=dev)
        self.part_o = torch.zeros(MAX_BATCH, a.num_heads, MAX_SPLITS, a.head_dim, dtype=torch.float32, device=dev)
        self.part_m = torch.zeros(MAX_BATCH, a.num_heads, MAX_SPLITS, dtype=torch.float32, device=dev)
        self.part_l = torch.zeros_like(self.part_m)
        self.act = torch.zeros(MAX_BATCH, a.intermediate_size, dtype=dt, device=dev)
        self.logits = torch.zeros(MAX_BATCH, a.vocab_size, dtype=torch.float32, device=dev)
        # torch's eager step casts the fp32 tables to the model's dtype before rotating
        self.cos, self.sin = model.rope.cos.to(dt).contiguous(), model.rope.sin.to(dt).contiguous()
        self.layers = [(b.attn_norm.weight, b.attn.qkv_proj.weight, b.attn.o_proj.weight, b.mlp_norm.weight,
                        b.mlp.gate_up_proj.weight, b.mlp.down_proj.weight) for b in model.layers]
        for w in (model.embed.weight, *[w for layer in self.layers for w in layer]):
            if not w.is_contiguous() or w.dtype != dt:
                raise ValueError("the fused step reads contiguous weights in the pool's dtype")
        self.head_w = model.embed.weight if model.lm_head is None else model.lm_head.weight

    def splits(self, width: int) -> tuple[int, int]:
        """(splits, tiles a split) of a context of ``width`` blocks: up to ``MAX_SPLITS`` splits,
        tiles a split a power of two (each count compiles its own attention kernel)."""
        tiles = -(-width * self.block_size // TILE)
        per_split = 1 << (-(-tiles // MAX_SPLITS) - 1).bit_length()
        return -(-tiles // per_split), per_split

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx_lens: torch.Tensor,
                 tables: torch.Tensor) -> torch.Tensor:
        """Logits [b, vocab] (fp32) of b decode rows: int64 ids, positions, slots and context
        lengths [b], block tables [b, width] (every row's K/V goes to its slot first)."""
        k, a = self.k, self.args
        b, width = tables.shape
        if b > self.max_batch:
            raise ValueError(f"a fused step takes at most {self.max_batch} rows, got {b}")
        h, nh, nkv, d = a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim
        eps, scale = a.norm_eps, d ** -0.5
        splits, per_split = self.splits(width)
        hp = 1 << (h - 1).bit_length()
        nhp = 1 << (nh - 1).bit_length()
        fma = b <= ROW_FMA
        rows = b if fma else MAX_BATCH  # the row tile: a batch's own rows, or 16 for tl.dot
        bk, bn, head_bn, w = (BK_FMA, BN_FMA, HEAD_BN_FMA, NUM_WARPS_FMA) if fma else (BK, BN, HEAD_BN, NUM_WARPS)
        hb = min(HB_FMA if fma else 16, d // 2)
        inter = a.intermediate_size
        k.embed_kernel[(b,)](ids, self.model.embed.weight, self.res, h, hp)
        for i, (an, qkv, o, mn, gu, down) in enumerate(self.layers):
            kc, vc = self.pool[i, 0], self.pool[i, 1]
            k.qkv_rope_kernel[(nh + 2 * nkv, d // 2 // hb)](
                self.res, an, qkv, positions, self.cos, self.sin, slots, self.q, kc, vc, b, eps,
                h, nh, nkv, d, rows, bk, hb, num_warps=w)
            k.attention_kernel[(b, nkv, splits)](
                self.q, kc, vc, tables, ctx_lens, self.part_o, self.part_m, self.part_l, width, scale, per_split,
                nh, nkv, d, self.group, self.group_tile, self.block_size, TILE, MAX_SPLITS, num_warps=w)
            k.oproj_kernel[(-(-h // bn),)](self.part_o, self.part_m, self.part_l, o, self.res, b, splits,
                                          nh, nhp, d, h, rows, bn, MAX_SPLITS, num_warps=w)
            k.gate_up_kernel[(-(-inter // bn),)](self.res, mn, gu, self.act, b, eps, h, inter, rows, bk, bn,
                                                 num_warps=w)
            k.down_kernel[(-(-h // bn),)](self.act, down, self.res, b, inter, h, rows, bk, bn, num_warps=w)
        k.head_kernel[(-(-a.vocab_size // head_bn),)](self.res, self.model.norm.weight, self.head_w, self.logits, b,
                                                      eps, h, a.vocab_size, rows, bk, head_bn, num_warps=w)
        return self.logits[:b]

    def kernels_a_step(self) -> int:
        return 2 + 5 * self.args.num_layers
