"""The Triton kernels of a fused decode step (``model/fused_step.py`` says what each computes and
launches them). Imported only there, when a fused step is built: ``triton`` is needed then and
not before (the CPU build of the project has no use for it; the tests run these kernels on the
CPU through Triton's interpreter, ``TRITON_INTERPRET=1``, which is read when this module loads).

Shapes: B rows (a padded decode batch, at most the row tile ``BB``), hidden H, NH query heads
and NKV KV heads of D dims, I intermediate, V vocabulary. Row tiles are ``BB``, masked to B: 16
(the smallest ``tl.dot`` takes) or, for a batch of 1 or 2, 1 or 2 rows multiplied by FMAs
(``_mm``). Every product accumulates in fp32 and rounds to the model's dtype where torch's eager
ops round (after each product, the rotary terms, SwiGLU and each residual add); the norm is
applied as a scale after the product (``_scaled``), one rounding apart from torch's.
"""
import os

import triton
import triton.language as tl

# Triton's interpreter (3.6) multiplies bf16 tiles in tl.dot as if they were another type: there
# the tiles are widened to fp32 first, which sums the same products (exact in fp32) in fp32, as
# the card's bf16 tl.dot does
_WIDEN_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _dot(a, b):
    if _WIDEN_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _mm(a, b, BB: tl.constexpr):
    """a [BB, K] @ b [K, N] in fp32: tl.dot from 16 rows (its smallest tile), FMAs below (a
    batch-1 or -2 step: no padded rows)."""
    if BB >= 16:
        return _dot(a, b)
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def embed_kernel(ids, emb, res, H: tl.constexpr, BH: tl.constexpr):
    """res[b] = emb[ids[b]]; grid (B,)."""
    b = tl.program_id(0)
    tok = tl.load(ids + b)
    k = tl.arange(0, BH)
    tl.store(res + b * H + k, tl.load(emb + tok * H + k, mask=k < H), mask=k < H)


@triton.jit
def _scaled(res, norm_w, kk, B, H: tl.constexpr, BB: tl.constexpr):
    """Columns kk of res * norm_w in the model's dtype ([BB, len(kk)]) and each row's sum of
    squares over them. RMSNorm is a per-row scale, so a product over these tiles, scaled by
    ``_rstd`` of the summed squares after the loop, is the normed product in one pass over res
    and the weight (torch rounds x * rstd before the weight's product: one rounding apart)."""
    rb = tl.arange(0, BB)
    km = kk < H
    x = tl.load(res + rb[:, None] * H + kk[None, :], mask=(rb < B)[:, None] & km[None, :], other=0.0)
    nw = tl.load(norm_w + kk, mask=km, other=0.0)
    x = x.to(tl.float32)
    return (x * nw.to(tl.float32)[None, :]).to(nw.dtype), tl.sum(x * x, axis=1)


@triton.jit
def _rstd(ss, eps, H: tl.constexpr):
    """1 / RMS of rows whose squares sum to ss (torch's rms_norm in fp32)."""
    return 1.0 / tl.sqrt(ss / H + eps)


@triton.jit
def _rows(w, rows, ok, kk, H: tl.constexpr):
    """[len(kk), len(rows)]: a weight's rows (of H columns) at columns kk, transposed for tl.dot."""
    return tl.load(w + rows[None, :] * H + kk[:, None], mask=ok[None, :] & (kk < H)[:, None], other=0.0)


@triton.jit
def _normed_rows(res, norm_w, w, rows_a, rows_b, ok, B, eps, H: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr,
                 RN: tl.constexpr, PAIR: tl.constexpr):
    """RMSNorm(res) * norm_w times RN rows of w, and (``PAIR``) a second set of RN rows: [BB, RN]
    fp32 each (the second zeros without PAIR), in one pass over res and the rows (``_scaled``)."""
    ss = tl.zeros([BB], dtype=tl.float32)
    a = tl.zeros([BB, RN], dtype=tl.float32)
    b = tl.zeros([BB, RN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        xs, sq = _scaled(res, norm_w, kk, B, H, BB)
        ss += sq
        a += _mm(xs, _rows(w, rows_a, ok, kk, H), BB)
        if PAIR:
            b += _mm(xs, _rows(w, rows_b, ok, kk, H), BB)
    rstd = _rstd(ss, eps, H)[:, None]
    return a * rstd, b * rstd


@triton.jit
def qkv_rope_kernel(res, norm_w, w, positions, cos, sin, slots, q_out, k_cache, v_cache, B, eps,
                    H: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                    BB: tl.constexpr, BK: tl.constexpr, HB: tl.constexpr):
    """Attention's norm, the q/k/v product, RoPE on q and k, and K/V written to the pool at each
    row's slot (q to ``q_out`` [B, NH, D]). Grid (NH + 2 NKV heads, D / 2 / HB): a program takes
    HB dims of a head's first half and the HB dims D/2 past them, the pairs RoPE rotates."""
    head = tl.program_id(0)
    half: tl.constexpr = D // 2
    dl = tl.program_id(1) * HB + tl.arange(0, HB)
    ok = dl < half
    rb = tl.arange(0, BB)
    bm = rb < B
    m2 = bm[:, None] & ok[None, :]
    # the rotary tables and the slots first: their loads overlap the weight's
    p = tl.load(positions + rb, mask=bm, other=0)
    at = p[:, None] * D + dl[None, :]
    c_lo = tl.load(cos + at, mask=m2, other=0.0).to(tl.float32)
    c_hi = tl.load(cos + at + half, mask=m2, other=0.0).to(tl.float32)
    s_lo = tl.load(sin + at, mask=m2, other=0.0).to(tl.float32)  # the table's sign is folded in
    s_hi = tl.load(sin + at + half, mask=m2, other=0.0).to(tl.float32)
    slot = tl.load(slots + rb, mask=bm, other=0)
    lo, hi = _normed_rows(res, norm_w, w, head * D + dl, head * D + half + dl, ok, B, eps, H, BB, BK, HB, True)
    dt = norm_w.dtype.element_ty
    lo = lo.to(dt)
    hi = hi.to(dt)
    if head < NH + NKV:  # rotate: x * cos + rotate_half(x) * sin, each product rounded as torch's
        lo32 = lo.to(tl.float32)
        hi32 = hi.to(tl.float32)
        lo = ((lo32 * c_lo).to(dt).to(tl.float32) + (hi32 * s_lo).to(dt).to(tl.float32)).to(dt)
        hi = ((hi32 * c_hi).to(dt).to(tl.float32) + (lo32 * s_hi).to(dt).to(tl.float32)).to(dt)
    if head < NH:
        out = q_out + (rb[:, None] * NH + head) * D + dl[None, :]
    else:
        if head < NH + NKV:
            out = k_cache + (slot[:, None] * NKV + (head - NH)) * D + dl[None, :]
        else:
            out = v_cache + (slot[:, None] * NKV + (head - NH - NKV)) * D + dl[None, :]
    tl.store(out, lo, mask=m2)
    tl.store(out + half, hi, mask=m2)


@triton.jit
def attention_kernel(q, k_cache, v_cache, tables, ctx_lens, part_o, part_m, part_l, W, scale,
                     TPS: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                     BS: tl.constexpr, TS: tl.constexpr, SP: tl.constexpr):
    """One decode row's query heads of one KV head over one split of its context (paged: block
    table rows of W entries, blocks of BS tokens), TS tokens at a time with an online softmax.
    Writes the split's unnormalised output and its running max and sum (combined by
    ``oproj_kernel``). Grid (B, NKV, splits); TPS tiles a split (a power of two: one compiled
    kernel a few context buckets)."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(ctx_lens + b)
    r = tl.arange(0, GP)
    d = tl.arange(0, D)
    rm = r < G
    qt = tl.load(q + (b * NH + g * G + r[:, None]) * D + d[None, :], mask=rm[:, None], other=0.0)
    m = tl.full([GP], -1e30, tl.float32)
    lsum = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    start = s * TPS * TS
    for t in range(0, TPS):  # tiles past the context are masked out (no loads)
        toks = start + t * TS + tl.arange(0, TS)
        valid = toks < ctx
        blk = tl.load(tables + b * W + toks // BS, mask=valid, other=0)
        at = ((blk * BS + toks % BS)[:, None] * NKV + g) * D + d[None, :]
        kt = tl.load(k_cache + at, mask=valid[:, None], other=0.0)
        vt = tl.load(v_cache + at, mask=valid[:, None], other=0.0)
        sc = _dot(qt, tl.trans(kt)) * scale
        sc = tl.where(valid[None, :], sc, -1e30)
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.where(valid[None, :], tl.exp(sc - m_new[:, None]), 0.0)
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt)
        m = m_new
    hrow = b * NH + g * G + r
    tl.store(part_o + (hrow[:, None] * SP + s) * D + d[None, :], acc, mask=rm[:, None])
    tl.store(part_m + hrow * SP + s, m, mask=rm)
    tl.store(part_l + hrow * SP + s, lsum, mask=rm)


@triton.jit
def _add_residual(res, acc, n, row0, B, H: tl.constexpr, BB: tl.constexpr):
    """res[rows, n] = res[rows, n] + acc for the BB rows from ``row0``, the product rounded first
    (torch's Linear, then its add)."""
    rb = row0 + tl.arange(0, BB)
    m2 = (rb < B)[:, None] & (n < H)[None, :]
    at = res + rb[:, None] * H + n[None, :]
    r = tl.load(at, mask=m2, other=0.0)
    out = acc.to(r.dtype).to(tl.float32)
    tl.store(at, (r.to(tl.float32) + out).to(r.dtype), mask=m2)


@triton.jit
def _combined(part_o, part_m, part_l, at, ms, live, D: tl.constexpr):
    """The attention splits at ``at`` ([R, SP] entries of the partial buffers, ``ms`` their mask)
    combined: [R, D] fp32, each row's output normalised (rows not ``live``: 0)."""
    d = tl.arange(0, D)
    mm = tl.load(part_m + at, mask=ms, other=-1e30)
    ll = tl.load(part_l + at, mask=ms, other=0.0)
    top = tl.max(mm, axis=1)
    wt = tl.where(ms, tl.exp(mm - top[:, None]), 0.0)
    total = tl.where(live, tl.sum(wt * ll, axis=1), 1.0)
    po = tl.load(part_o + at[:, :, None] * D + d[None, None, :], mask=ms[:, :, None], other=0.0)
    return tl.sum(wt[:, :, None] * po, axis=1) / total[:, None]


@triton.jit
def oproj_kernel(part_o, part_m, part_l, w, res, B, S, NH: tl.constexpr, NHP: tl.constexpr, D: tl.constexpr,
                 H: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr, SP: tl.constexpr):
    """The attention splits combined (each head's output rounded, as attention's), the output
    projection's BN columns, and the residual add. Grid (H / BN,). A 16-row tile takes the heads
    one by one (tl.dot a head); a batch of 1 or 2 takes every head at once, its row alone (no
    chain of nine dependent loads)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    sp = tl.arange(0, SP)
    d = tl.arange(0, D)
    if BB >= 16:
        rb = tl.arange(0, BB)
        bm = rb < B
        ms = bm[:, None] & (sp[None, :] < S)
        acc = tl.zeros([BB, BN], dtype=tl.float32)
        for h in tl.static_range(NH):
            wo = tl.load(w + n[None, :] * (NH * D) + h * D + d[:, None], mask=(n < H)[None, :], other=0.0)
            o = _combined(part_o, part_m, part_l, (rb[:, None] * NH + h) * SP + sp[None, :], ms, bm, D)
            acc += _mm(o.to(wo.dtype), wo, BB)
        _add_residual(res, acc, n, 0, B, H, BB)
    else:
        hh = tl.arange(0, NHP)
        hm = hh < NH
        nm = n < H
        wo = tl.load(w + n[None, None, :] * (NH * D) + hh[:, None, None] * D + d[None, :, None],
                     mask=hm[:, None, None] & nm[None, None, :], other=0.0)  # [NHP, D, BN]
        for r in tl.static_range(BB):
            ms = hm[:, None] & (sp[None, :] < S) & (r < B)
            o = _combined(part_o, part_m, part_l, (r * NH + hh[:, None]) * SP + sp[None, :], ms, hm, D)
            o = o.to(wo.dtype)  # [NHP, D], rounded as attention's output
            out = tl.sum(tl.sum(o.to(tl.float32)[:, :, None] * wo.to(tl.float32), axis=0), axis=0)  # [BN]
            _add_residual(res, out[None, :], n, r, B, H, 1)


@triton.jit
def gate_up_kernel(res, norm_w, w, act, B, eps, H: tl.constexpr, I: tl.constexpr, BB: tl.constexpr,
                   BK: tl.constexpr, BN: tl.constexpr):
    """The MLP's norm, gate and up products and SwiGLU: act[:, j] = silu(gate_j) * up_j for BN
    of the I columns. Grid (I / BN,)."""
    j = tl.program_id(0) * BN + tl.arange(0, BN)
    ok = j < I
    dt = norm_w.dtype.element_ty
    gate, up = _normed_rows(res, norm_w, w, j, I + j, ok, B, eps, H, BB, BK, BN, True)
    gate = gate.to(dt).to(tl.float32)
    up = up.to(dt).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    rb = tl.arange(0, BB)
    tl.store(act + rb[:, None] * I + j[None, :], (silu * up).to(dt), mask=(rb < B)[:, None] & ok[None, :])


@triton.jit
def down_kernel(x, w, res, B, K: tl.constexpr, H: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr,
                BN: tl.constexpr):
    """res[:, n] += x @ w[n]^T for BN of the H columns (x [B, K]). Grid (H / BN,)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    rb = tl.arange(0, BB)
    bm = rb < B
    acc = tl.zeros([BB, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        xt = tl.load(x + rb[:, None] * K + kk[None, :], mask=bm[:, None] & km[None, :], other=0.0)
        acc += _mm(xt, _rows(w, n, n < H, kk, K), BB)
    _add_residual(res, acc, n, 0, B, H, BB)


@triton.jit
def head_kernel(res, norm_w, w, logits, B, eps, H: tl.constexpr, V: tl.constexpr, BB: tl.constexpr,
                BK: tl.constexpr, BN: tl.constexpr):
    """The final norm and BN of the LM head's V logits, kept as fp32 sums. Grid (V / BN,)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    ok = n < V
    acc, _ = _normed_rows(res, norm_w, w, n, n, ok, B, eps, H, BB, BK, BN, False)
    rb = tl.arange(0, BB)
    tl.store(logits + rb[:, None] * V + n[None, :], acc, mask=(rb < B)[:, None] & ok[None, :])
