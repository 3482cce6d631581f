"""Paged attention over one instance's KV pool, with backends chosen by name.

A step's tokens are laid out as::

    [ prefill seq 0 | prefill seq 1 | ... | decode tok 0 | decode tok 1 | ... | pad ... ]
      \\_________ num_prefill_tokens _____/ \\____ num_decode_tokens ______/

Prefill sequences (a chunk of a prompt, or a recompute) attend causally to everything their
request has in the cache up to each token, so a chunk sees its own earlier chunks' KV. Decode
tokens are batched: one query each. Pad tokens (TetriInfer's fixed-size chunk padding) cost the
linear layers like any token but write no KV and attend to nothing.

Backends: ``reference`` (plain torch matmul + softmax; CPU and CUDA), ``sdpa`` (torch's
``scaled_dot_product_attention`` over gathered blocks), ``native`` (CPU: our C++ kernels from
``model/csrc``, which read K/V in place: paged decode, and for bf16 prompt chunks paged prefill;
SDPA for other chunks), ``flash``
(flash-attn's paged kernel for decode rows, CUDA only, when ``flash_attn`` imports and the pool's
blocks are a multiple of 256 tokens in fp16/bf16: ``flash_refusal``; prompt chunks take sdpa).
``pick_backend("auto")`` takes native on CPU when it compiles and sdpa on CUDA (flash where it
can read the pool).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

BACKENDS = ("reference", "sdpa", "native", "flash")


@dataclass(frozen=True)
class PrefillSeq:
    """One request's query tokens in this step, as a slice of the step's tokens."""

    start: int  # first token index in the step
    end: int  # one past the last
    ctx_len: int  # tokens in the cache for this request after this step's write
    block_ids: torch.Tensor  # [num_blocks] long, the request's blocks covering ctx_len
    mask: Optional[torch.Tensor]  # [q_len, ctx_len] bool (True = attend); None = plain causal


@dataclass(frozen=True)
class AttentionMeta:
    """Everything attention needs for one step; built once by the runner, shared by all layers."""

    slot_mapping: torch.Tensor  # [num_real_tokens] long: flat pool slot each token's K/V goes to
    prefills: tuple[PrefillSeq, ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    block_size: int
    decode_block_tables: Optional[torch.Tensor]  # [B_dec, max_blocks] long (padded with block 0)
    decode_ctx_lens: Optional[torch.Tensor] = None  # [B_dec] int64

    @property
    def num_real_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @functools.cached_property
    def chunk_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt chunks as the native kernels take them (``native.chunk_tables``), built once
        a step, not once a layer."""
        from model import native

        return native.chunk_tables(self.prefills)

    @functools.cached_property
    def decode_bias(self) -> torch.Tensor:
        """[B_dec, 1, 1, max_blocks * block_size] float, 0 or -inf: the padded decode batch's mask
        for the sdpa and reference backends (built on first use: the native and flash kernels read
        the context lengths instead, and a batch-1 step is short enough for its cost to show)."""
        width = self.decode_block_tables.shape[1] * self.block_size
        cols = torch.arange(width, device=self.decode_ctx_lens.device)
        bias = torch.zeros(self.decode_ctx_lens.shape[0], 1, 1, width, device=self.decode_ctx_lens.device)
        return bias.masked_fill_(cols[None, None, None, :] >= self.decode_ctx_lens[:, None, None, None], float("-inf"))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMeta) -> None:
    """Store this step's K/V: caches are [num_blocks, block_size, H_kv, D]; k, v [T, H_kv, D]."""
    n = meta.num_real_tokens
    h_kv, d = k_cache.shape[-2:]
    k_cache.view(-1, h_kv, d).index_copy_(0, meta.slot_mapping, k[:n])
    v_cache.view(-1, h_kv, d).index_copy_(0, meta.slot_mapping, v[:n])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMeta, scale: float, backend: str) -> torch.Tensor:
    """q: [T, H, D] (after RoPE); returns [T, H, D]. K/V of this step must already be written."""
    t = q.shape[0]
    # common shapes first: a pure decode batch or one lone chunk needs no output scatter
    if not meta.prefills and meta.num_decode_tokens == t:
        return _decode_batch(q, k_cache, v_cache, meta, scale, backend)
    if backend == "native" and _native_prefill(q, k_cache):
        from model import native

        out = native.paged_prefill(q, k_cache, v_cache, *meta.chunk_tables, scale)  # decode and pad rows 0
        if meta.num_decode_tokens:
            s, e = meta.num_prefill_tokens, meta.num_real_tokens
            out[s:e] = _decode_batch(q[s:e], k_cache, v_cache, meta, scale, backend)
        return out
    if len(meta.prefills) == 1 and not meta.num_decode_tokens and meta.prefills[0].end == t:
        return _prefill_one(q, k_cache, v_cache, meta.prefills[0], scale, backend)
    out = torch.zeros_like(q)
    for seq in meta.prefills:
        out[seq.start:seq.end] = _prefill_one(q[seq.start:seq.end], k_cache, v_cache, seq, scale, backend)
    if meta.num_decode_tokens:
        s = meta.num_prefill_tokens
        e = s + meta.num_decode_tokens
        out[s:e] = _decode_batch(q[s:e], k_cache, v_cache, meta, scale, backend)
    return out


def _native_prefill(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    from model import native

    return q.device.type == "cpu" and native.prefill_applies(q, k_cache)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, ctx_len: int) -> torch.Tensor:
    # cache: [num_blocks, bs, H_kv, D] -> [ctx_len, H_kv, D]
    h_kv, d = cache.shape[-2:]
    return cache[block_ids].reshape(-1, h_kv, d)[:ctx_len]


def _prefill_one(q, k_cache, v_cache, seq: PrefillSeq, scale: float, backend: str) -> torch.Tensor:
    k = _gather(k_cache, seq.block_ids, seq.ctx_len)  # [ctx, H_kv, D]
    v = _gather(v_cache, seq.block_ids, seq.ctx_len)
    q_len, num_heads, d = q.shape
    groups = num_heads // k.shape[1]
    qh = q.transpose(0, 1)  # [H, q_len, D]
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [H_kv, ctx, D]
    if backend != "reference":
        causal = seq.mask is None
        return F.scaled_dot_product_attention(
            qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0), attn_mask=seq.mask, is_causal=causal,
            scale=scale, enable_gqa=groups > 1).squeeze(0).transpose(0, 1)
    # reference: group query heads under their KV head -> [H_kv, groups*q_len, D]
    qg = qh.reshape(k.shape[1], groups * q_len, d)
    scores = torch.matmul(qg.float(), kh.float().transpose(1, 2)) * scale  # [H_kv, G*q, ctx]
    mask = seq.mask if seq.mask is not None else _causal(q_len, seq.ctx_len, q.device)
    scores = scores.view(k.shape[1], groups, q_len, -1).masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).view(k.shape[1], groups * q_len, -1)
    out = torch.matmul(probs, vh.float()).view(num_heads, q_len, d)
    return out.transpose(0, 1).to(q.dtype)


def _causal(q_len: int, ctx_len: int, device) -> torch.Tensor:
    """[q_len, ctx_len] bool: query t sits at position ctx_len - q_len + t."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    return torch.arange(ctx_len, device=device)[None, :] <= q_pos[:, None]


def causal_mask(q_len: int, ctx_len: int, device) -> Optional[torch.Tensor]:
    """The mask a ``PrefillSeq`` needs: None when the chunk starts at position 0 (plain causal)."""
    return None if q_len == ctx_len else _causal(q_len, ctx_len, device)


def _decode_batch(q, k_cache, v_cache, meta: AttentionMeta, scale: float, backend: str) -> torch.Tensor:
    if backend == "flash":
        return _flash_decode(q, k_cache, v_cache, meta, scale)
    if backend == "native":
        from model import native

        return native.paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_ctx_lens, scale)
    bt = meta.decode_block_tables  # [B, nb]
    b, num_heads, d = q.shape
    h_kv = k_cache.shape[2]
    k = k_cache[bt].view(b, -1, h_kv, d)  # [B, ctx_max, H_kv, D]
    v = v_cache[bt].view(b, -1, h_kv, d)
    groups = num_heads // h_kv
    qg = q.view(b, h_kv, groups, d)  # [B, H_kv, G, D]
    if backend == "sdpa":
        out = F.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=meta.decode_bias.to(q.dtype), scale=scale)
        return out.reshape(b, num_heads, d)
    scores = torch.matmul(qg.float(), k.float().permute(0, 2, 3, 1)) * scale  # [B, H_kv, G, ctx]
    probs = (scores + meta.decode_bias).softmax(-1)
    out = torch.matmul(probs, v.float().transpose(1, 2))  # [B, H_kv, G, D]
    return out.reshape(b, num_heads, d).to(q.dtype)


def pick_backend(name: str, device: str, native_ok: bool = True, block_size: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None) -> str:
    """Resolve ``auto`` to the fastest backend that works on ``device``; check explicit names.
    ``native_ok`` False (kernels ``fallback``) keeps our C++ kernel out. ``block_size`` and
    ``dtype``, where known, decide whether flash-attn's paged kernel can take the pool
    (``flash_refusal``): ``auto`` then picks sdpa instead, an explicit ``flash`` is refused."""
    cuda = device.startswith("cuda")
    if name == "auto":
        if cuda:
            return "flash" if flash_available() and flash_refusal(block_size, dtype) is None else "sdpa"
        from model import native

        return "native" if native_ok and native.available() else "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"bad attention backend {name!r}: choose one of auto, {', '.join(BACKENDS)}")
    if name == "native" and not native_ok:
        raise ValueError("attention backend 'native' is one of aserve's C++ kernels, which kernels 'fallback' "
                         "turns off: use auto, sdpa or reference")
    if name == "flash" and not flash_available():
        raise ValueError("attention backend 'flash' needs CUDA and the flash_attn package (pip install '.[gpu]')")
    if name == "flash" and flash_refusal(block_size, dtype):
        raise ValueError(f"attention backend 'flash': {flash_refusal(block_size, dtype)}; or use --attention sdpa")
    if name == "native" and cuda:
        raise ValueError("attention backend 'native' is the CPU kernel; use sdpa or flash on CUDA")
    return name


FLASH_PAGE_MULTIPLE = 256  # flash-attn 2's paged KV takes pages of a multiple of 256 tokens (its issue #828)


def flash_refusal(block_size: Optional[int], dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why flash-attn's paged kernel cannot read a pool of ``block_size``-token blocks in
    ``dtype`` (None where it can, or where a value is not known yet)."""
    if block_size is not None and block_size % FLASH_PAGE_MULTIPLE:
        return (f"flash-attn's paged kernel needs KV blocks of a multiple of {FLASH_PAGE_MULTIPLE} tokens, "
                f"got {block_size}: pass --block-size {FLASH_PAGE_MULTIPLE}")
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn runs in fp16 or bf16, got {str(dtype).removeprefix('torch.')}: pass --dtype bf16"
    return None


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _flash_decode(q, k_cache, v_cache, meta: AttentionMeta, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_with_kvcache

    out = flash_attn_with_kvcache(
        q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.decode_ctx_lens.to(torch.int32),
        block_table=meta.decode_block_tables.to(torch.int32), softmax_scale=scale, causal=True)
    return out.squeeze(1)
