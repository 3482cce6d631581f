"""Our C++ CPU kernels, and the fallback each one has (torch's own ops: ``--kernels fallback``),
against float32 references: paged decode attention (the bf16 fast path, the general vector and
scalar paths, fp32 and bf16, ragged contexts, contexts split over threads), the packed bf16
products (plain, with bias, with a residual add, with SwiGLU) and a whole LLaMA step on every
kernel path. The fallbacks' tests run on every machine; ours skip where they cannot run."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model import native
from model.attention import AttentionMeta, paged_attention

needs_native = pytest.mark.skipif(not native.available(), reason="aserve's C++ kernels do not build here")
needs_bf16 = pytest.mark.skipif(not native.bf16_linear_available(), reason="no AVX512-BF16 kernels here")
needs_f32 = pytest.mark.skipif(not native.f32_linear_available(), reason="no AVX2 FMA kernels here")
DECODE_PATHS = [pytest.param("native", marks=needs_native), "fallback"]
PRODUCT_PATHS = [pytest.param("native", marks=needs_bf16), "fallback"]


def decode(path, q, k_cache, v_cache, tables, lens, scale):
    """Paged decode attention by our kernel, or by its fallback (the sdpa backend over gathered blocks)."""
    if path == "native":
        return native.paged_decode(q, k_cache, v_cache, tables, lens, scale)
    meta = AttentionMeta(torch.zeros(0, dtype=torch.long), (), 0, q.shape[0], k_cache.shape[1], tables, lens)
    return paged_attention(q, k_cache, v_cache, meta, scale, "sdpa")


def dense_decode(q, k_cache, v_cache, tables, lens, scale):
    """The same attention with gathered, dense float32 tensors, one request at a time."""
    b, h, d = q.shape
    h_kv = k_cache.shape[2]
    out = torch.empty(b, h, d)
    for i in range(b):
        n = int(lens[i])
        k = k_cache[tables[i]].reshape(-1, h_kv, d)[:n].float().repeat_interleave(h // h_kv, dim=1)
        v = v_cache[tables[i]].reshape(-1, h_kv, d)[:n].float().repeat_interleave(h // h_kv, dim=1)
        p = (torch.einsum("hd,thd->ht", q[i].float(), k) * scale).softmax(-1)
        out[i] = torch.einsum("ht,thd->hd", p, v)
    return out


@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# (9, 3, 64) is the default model's layout (bf16: the fast path); (4, 4, 16) and (6, 2, 24) take the
# general paths (24: AVX-512's scalar one, AVX2's vector one); (3, 1, 12) the scalar path on every
# CPU; (8, 2, 128) and (16, 2, 64) the fast path's other instantiations
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (6, 2, 24), (3, 1, 12), (8, 2, 128),
                                                     (16, 2, 64)])
def test_paged_decode_matches_dense(path, dtype, tol, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(heads * head_dim)
    bs, max_blocks = 16, 6
    lens = torch.tensor([1, 15, 16, 17, 50, 96])  # partial blocks, exact blocks, one token
    k_cache = torch.randn(64, bs, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(64, bs, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(64, generator=g)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    got = decode(path, q, k_cache, v_cache, tables, lens, scale).float()
    want = dense_decode(q, k_cache, v_cache, tables, lens, scale)
    assert (got - want).abs().max().item() <= tol


@needs_native
@pytest.mark.parametrize("ctx", [1, 63, 64, 200, 1000])
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_paged_decode_splits_long_contexts_of_small_batches(ctx, block_size):
    """One request: its context is cut into chunks for the threads and merged back (bf16 fast
    path); block sizes under and over the kernel's 16-token tiles."""
    g = torch.Generator().manual_seed(ctx + block_size)
    nb = -(-ctx // block_size)
    k_cache = torch.randn(nb + 3, block_size, 3, 64, generator=g).bfloat16()
    v_cache = torch.randn(nb + 3, block_size, 3, 64, generator=g).bfloat16()
    tables = torch.randperm(nb + 3, generator=g)[:nb].view(1, nb)
    q = (torch.randn(1, 9, 64, generator=g) * 2).bfloat16()  # sharper softmax: chunks' maxima differ
    got = native.paged_decode(q, k_cache, v_cache, tables, torch.tensor([ctx]), 0.125).float()
    want = dense_decode(q, k_cache, v_cache, tables, torch.tensor([ctx]), 0.125)
    assert (got - want).abs().max().item() <= 2e-2


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_paged_decode_softmax_survives_large_scores(path):
    """Scores far apart (one dominant key) must not overflow or underflow into NaN."""
    k_cache = torch.zeros(4, 16, 1, 16)
    v_cache = torch.randn(4, 16, 1, 16)
    k_cache[0, 3] = 50.0  # q . k = 50 * 50 * 16 * scale: every other key is e^-big
    q = torch.full((1, 1, 16), 50.0)
    out = decode(path, q, k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([20]), 0.25)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0, 0], v_cache[0, 3], atol=1e-5)



def _close_to_float(got: torch.Tensor, want: torch.Tensor, k: int) -> bool:
    """One bf16 rounding of an fp32 sum (relative 2^-8) plus summation-order noise."""
    return bool(((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-4 * k ** 0.5).all())


@pytest.mark.parametrize("path", PRODUCT_PATHS)
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 13, 64, 130])  # blocks of six rows and their remainders
# groups of 64 rows: 1 (split between threads by k), 15 and 9 (one group split), 2, 16 (split evenly)
@pytest.mark.parametrize("n,k,bias", [(13, 64, False), (960, 576, False), (576, 1536, True), (96, 32, True),
                                      (1000, 1536, True), (70, 2, False)])
def test_linear_packed_matches_float_reference(path, rows, n, k, bias):
    g = torch.Generator().manual_seed(n + k + rows)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    assert path == "fallback" or native.packable(x, w)  # the packed kernel, not torch's matmul
    got = native.linear(x, w, b, native=path == "native")
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert _close_to_float(got, F.linear(x.float(), w.float(), None if b is None else b.float()), k)


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2])  # two: groups split between threads by k, summed in parts
@pytest.mark.parametrize("rows", [1, 6, 13, 64, 100])  # 13: in k-chunks; 64, 100: widened once a chunk (kWidenOnceRows)
@pytest.mark.parametrize("n,k,bias", [(13, 64, False), (576, 1536, True), (1000, 1536, True), (70, 2, False)])
def test_fp32_products_match_the_bf16_ones(threads, rows, n, k, bias):
    """The fp32-packed kind (``pack_f32``, FMAs) gives the float reference as the bf16 dot products
    do, through every epilogue: plain with bias, fp32 sums, the residual add and SwiGLU; and the
    bf16-packed weights widened to fp32 (``widen``, what steps take from ``wide_rows`` rows) give
    the fp32 kind's results bit for bit."""
    mod = native.load()
    g = torch.Generator().manual_seed(n + k + rows)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        p16, p32 = mod.pack_bf16(w, mod.ORDER_PLAIN), mod.pack_f32(w, mod.ORDER_PLAIN)
        assert p32.dtype == torch.float32 and p32.shape == (-(-n // 64), k, 64)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        for packed in (p16, p32):
            got = mod.linear_packed(x, packed, n, b)
            assert got.dtype == torch.bfloat16 and _close_to_float(got, want, k)
        assert torch.equal(mod.linear_packed(x, p16, n, b, widen=True), mod.linear_packed(x, p32, n, b))
        sums = mod.linear_packed(x, p32, n, None, True)
        assert sums.dtype == torch.float32 and (sums - F.linear(x.float(), w.float())).abs().max().item() <= 1e-3
        assert torch.equal(mod.linear_packed(x, p16, n, None, True, True), sums)
        h16 = torch.randn(rows, n, generator=g).bfloat16()
        h32, hw = h16.clone(), h16.clone()
        mod.linear_packed_add_(h16, x, p16)
        mod.linear_packed_add_(h32, x, p32)
        mod.linear_packed_add_(hw, x, p16, widen=True)
        assert (h16.float() - h32.float()).abs().max().item() <= 0.02 * h16.abs().max().item() + 1e-2
        assert torch.equal(hw, h32)
        if n % 64 == 0:  # SwiGLU: a fused gate_up of n = 2 I rows, packed in gate-up order
            g16 = mod.pack_bf16(w, mod.ORDER_GATE_UP)
            a16 = mod.silu_mul_packed(x, g16)
            a32 = mod.silu_mul_packed(x, mod.pack_f32(w, mod.ORDER_GATE_UP))
            assert a32.shape == (rows, n // 2)
            assert (a16.float() - a32.float()).abs().max().item() <= 0.02 * a16.abs().max().item() + 1e-2
            assert torch.equal(mod.silu_mul_packed(x, g16, widen=True), a32)
    finally:
        torch.set_num_threads(before)


@needs_bf16
@pytest.mark.parametrize("rows", [24, 31, 130, 515])  # kClaimRows (24) and up: rows claimed in units
@pytest.mark.parametrize("n,k", [(13, 64), (576, 1536), (960, 576), (3072, 576)])  # 1, 9, 15, 48 groups
def test_prompt_rows_claimed_by_two_threads_give_one_threads_sums(rows, n, k):
    """From 24 rows the threads claim units of (group, range of rows) from a counter instead of each
    taking a fixed share (so a thread slowed by another process takes fewer): every output's sum
    still runs over all of k in order, so two threads give one thread's results bit for bit, through
    every epilogue and both packed kinds, whichever thread took which unit."""
    mod = native.load()
    g = torch.Generator().manual_seed(n + k + rows)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    h = torch.randn(rows, n, generator=g).bfloat16()
    p16, p32 = mod.pack_bf16(w, mod.ORDER_PLAIN), mod.pack_f32(w, mod.ORDER_PLAIN)
    gate_up = mod.pack_bf16(w, mod.ORDER_GATE_UP) if n % 64 == 0 else None

    def products() -> list[torch.Tensor]:
        out = [mod.linear_packed(x, p16, n, b), mod.linear_packed(x, p32, n, b), mod.linear_packed(x, p16, n, None, True),
               mod.linear_packed(x, p16, n, b, widen=True)]
        added = h.clone()
        mod.linear_packed_add_(added, x, p16)
        out.append(added)
        if gate_up is not None:
            out.append(mod.silu_mul_packed(x, gate_up))
        return out

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = products()
        torch.set_num_threads(2)
        two = products()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, c) for a, c in zip(one, two))
    assert _close_to_float(one[0], F.linear(x.float(), w.float(), b.float()), k)


@pytest.mark.parametrize("path", PRODUCT_PATHS)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_packed_epilogues_match_torch_ops(path, rows):
    """SwiGLU in the product's epilogue (and its fallback, three torch ops) and the residual add
    give what torch's bf16 ops on float products give (each op rounded to bf16), up to the
    products' own summation order."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).bfloat16()
    gate_up = (torch.randn(2 * 1536, 576, generator=g) / 24).bfloat16()
    gate, up = F.linear(x.float(), gate_up.float()).bfloat16().chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert path == "fallback" or native.packable(x, gate_up)
    got = native.silu_mul(x, gate_up, native=path == "native")
    assert got.shape == want.shape and (got.float() - want.float()).abs().max().item() <= 0.02 * want.abs().max().item()
    if path == "fallback":
        return
    mod = native.load()
    # the default model's down weight: 9 groups of 64 rows, so two threads each sum part of one
    h = torch.randn(rows, 576, generator=g).bfloat16()
    act = torch.randn(rows, 1536, generator=g).bfloat16()
    down = (torch.randn(576, 1536, generator=g) / 40).bfloat16()
    want = h + F.linear(act.float(), down.float()).bfloat16()
    mod.linear_packed_add_(h, act, native.packed(down))
    assert (h.float() - want.float()).abs().max().item() <= 0.02 * want.abs().max().item()


def test_lm_head_fallback_logits_are_the_model_dtypes():
    """The fallback LM head: torch's bf16 product, as fp32, within one bf16 rounding of the sums."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 576, generator=g).bfloat16()
    w = (torch.randn(1000, 576, generator=g) / 4).bfloat16()
    got, want = native.logits(x, w, native=False), F.linear(x.float(), w.float())
    assert got.dtype == torch.float32 and torch.equal(got, F.linear(x, w).float())
    assert ((got - want).abs() <= want.abs() * 2 ** -8 + 1e-2).all()


@needs_bf16
def test_lm_head_logits_are_unrounded_fp32_sums():
    """Logits come back as the product's fp32 sums, not rounded to bf16 (which made near-ties
    ties at the 0.125 steps bf16 has between 16 and 32)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 576, generator=g).bfloat16()
    w = (torch.randn(1000, 576, generator=g) / 4).bfloat16()  # logits of size ~10-30
    assert native.packable(x, w)
    got = native.logits(x, w)
    want = F.linear(x.float(), w.float())
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-3 * want.abs().max().item()
    assert (got - want).abs().max().item() < 0.25 * (want.bfloat16().float() - want).abs().max().item()


@needs_bf16
def test_packed_copy_follows_the_weight():
    """An in-place change of a weight after its first product is seen: the packed copy is remade."""
    w = torch.randn(64, 32).bfloat16()
    x = torch.randn(2, 32).bfloat16()
    first = native.linear(x, w)
    w.mul_(2)
    assert torch.allclose(native.linear(x, w).float(), 2 * first.float(), rtol=2 ** -7)


@needs_bf16
def test_linear_dispatch_keeps_torch_where_ours_does_not_apply():
    w = torch.randn(40, 63).bfloat16()
    odd = torch.randn(2, 63).bfloat16()
    assert torch.equal(native.linear(odd, w), F.linear(odd, w))  # odd width: no k-pairs
    with torch.enable_grad():
        wg = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
        assert not native.packable(torch.randn(2, 64).bfloat16(), wg)
        assert native.linear(torch.randn(2, 64).bfloat16(), wg).requires_grad  # autograd: torch's
    with torch.no_grad():
        assert native.packable(torch.randn(2, 64).bfloat16(), wg)  # nothing to track: ours


@needs_f32
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 33])
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (100, 64, True), (64, 1536, False), (31, 7, True)])
def test_fp32_products_match_the_float_reference(threads, rows, n, k, bias):
    """``linear_f32`` over ``pack_f32x32``'s groups (an fp32 model's products on AVX2 CPUs):
    the double-precision product within fp32 summation noise, at any row count (blocks of three
    and the rest), a last group cut short (n not a multiple of 32), odd widths, with and without
    bias, over k-chunks (k 1,536: twelve of them), at one thread and split over two."""
    mod = native.load()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(rows * 1000 + n)
        w, x = torch.randn(n, k), torch.randn(rows, k)
        b = torch.randn(n) if bias else None
        p = mod.pack_f32x32(w)
        assert p.dtype == torch.float32 and p.shape == (-(-n // 32), k, 32)
        got = mod.linear_f32(x, p, n, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert (got.double() - want).abs().max().item() <= 1e-4 * k ** 0.5
    finally:
        torch.set_num_threads(old)


@needs_f32
def test_fp32_linear_dispatch():
    """fp32 products go to ours (``linear``, ``logits``, ``silu_mul``) within fp32 noise of torch's;
    the fallback (``native=False``) and autograd keep torch's own; a weight changed in place has
    its packed copy remade."""
    w, x = torch.randn(128, 64), torch.randn(3, 64)
    assert native.f32_packable(x, w)
    assert torch.allclose(native.linear(x, w), F.linear(x, w), atol=1e-5)
    assert torch.equal(native.linear(x, w, native=False), F.linear(x, w))
    assert torch.allclose(native.logits(x, w), F.linear(x, w), atol=1e-5)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    assert torch.allclose(native.silu_mul(x, w), F.silu(gate) * up, atol=1e-5)
    first = native.linear(x, w)
    w.mul_(2)
    assert torch.allclose(native.linear(x, w), 2 * first, atol=1e-5)
    with torch.enable_grad():
        wg = torch.randn(40, 64, requires_grad=True)
        assert not native.f32_packable(x, wg)
        assert native.linear(x, wg).requires_grad
    assert not native.f32_packable(x.bfloat16(), w.bfloat16())


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 8, 100])
def test_fp32_norm_and_rope_match_torch(threads, rows):
    """An fp32 step's RMSNorm and RoPE in one call each give torch's ops' results within fp32 noise
    (widths with a tail past the 16-lane loop; rows split over threads); the layers take them for
    fp32 x and keep torch's ops in the fallback."""
    from model.layers import RMSNorm, RotaryEmbedding, apply_rope

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(rows)
        for d in (576, 37):
            x, w = torch.randn(rows, d) * 3, torch.randn(d)
            want = F.rms_norm(x, (d,), w, 1e-5)
            assert torch.allclose(native.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-5)
            norm = RMSNorm(d, 1e-5)
            norm.weight.data.copy_(w)
            with torch.no_grad():
                assert torch.allclose(norm(x), want, rtol=1e-5, atol=1e-5)
                norm.native = False
                assert torch.equal(norm(x), want)
        rope = RotaryEmbedding(64, 4096, 10000.0)
        x = torch.randn(rows, 12, 64)
        cos, sin = rope.tables(torch.randint(0, 4096, (rows,)), torch.float32)
        want = apply_rope(x, cos, sin)
        assert torch.allclose(native.rope(x, cos, sin), want, rtol=1e-5, atol=1e-5)
        assert torch.allclose(apply_rope(x, cos, sin, native_ok=True), want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_packed_products_reject_bad_shapes():
    if not native.bf16_linear_available():
        pytest.skip("CPU has no AVX512-BF16")
    mod = native.load()
    with pytest.raises(RuntimeError, match="even"):
        mod.pack_bf16(torch.randn(4, 47).bfloat16())
    p = native.packed(torch.randn(4, 32).bfloat16())
    with pytest.raises(RuntimeError, match="columns"):
        mod.linear_packed(torch.randn(1, 48).bfloat16(), p, 4)
    with pytest.raises(RuntimeError, match="bias"):
        mod.linear_packed(torch.randn(1, 32).bfloat16(), p, 4, torch.randn(3).bfloat16())


def _tiny_llama32():
    """The tiny LLaMA with head size 32 (the prefill kernel takes 32, 64 and 128), 2 query heads a KV head."""
    from tests.tiny import LLAMA

    return dict(LLAMA, hidden_size=128)


# (context before the step, tokens in the step) per request: one token is a decode row, more a
# prompt chunk (from position 0, or a later chunk); 12 decode rows make two blocks of six rows
STEPS = {
    "decode 1": [(9, 1)],
    "decode 5": [(5 + 7 * i, 1) for i in range(5)],
    "decode 12": [(5 + 7 * i, 1) for i in range(12)],
    "one chunk": [(0, 37)],
    "mixed + pad": [(0, 20), (33, 17), (12, 1), (40, 1), (3, 1)],
}


def _llama_setup(kind: str, kernels: str, backend: str):
    """The tiny LLaMA in bf16 on ``kernels`` and ``backend`` and its fp32 reference, each with the
    context of STEPS[kind] in its cache: (model, runner, the step, (fp32 runner, fp32 model))."""
    from scheduling.step import SeqStep, StepPlan
    from tests.tiny import hf_model, make_runner, ours
    from model.loader import model_from_state_dict

    cfg = _tiny_llama32()
    hf = hf_model(cfg)
    model = model_from_state_dict(cfg, hf.state_dict(), torch.bfloat16, "cpu", backend, kernels)
    m32 = ours(cfg, hf, torch.float32, "reference")
    (runner, blocks), (r32, _) = make_runner(model), make_runner(m32)
    g = torch.Generator().manual_seed(len(kind))
    seqs = []
    for i, (before, n) in enumerate(STEPS[kind]):
        ids = torch.randint(0, cfg["vocab_size"], (before + n,), generator=g).tolist()
        block_ids = []
        blocks.grow(block_ids, len(ids))
        if before:
            for r in (runner, r32):
                r.forward_logits(StepPlan((SeqStep(f"r{i}", tuple(ids[:before]), 0, tuple(block_ids)),)))
        seqs.append(SeqStep(f"r{i}", tuple(ids[before:]), before, tuple(block_ids)))
    chunks, decodes = [s for s in seqs if len(s.token_ids) > 1], [s for s in seqs if len(s.token_ids) == 1]
    return model, runner, StepPlan(tuple(chunks + decodes), num_pad_tokens=3 if "pad" in kind else 0), (r32, m32)


@needs_bf16
@pytest.mark.parametrize("kind", list(STEPS))
def test_llama_forward_step_matches_op_by_op(kind):
    """One ``native.llama_forward`` call for a step (decode rows, prompt chunks that start at 0 or
    continue a request, pad rows) gives the op-by-op bf16 path's (kernels ``unfused``) hidden
    states and K/V (within bf16 rounding), and is as close to an fp32 run as that path."""
    model, runner, step, (r32, m32) = _llama_setup(kind, "native", "native")
    before_kv = runner.kv.pool.clone()
    with torch.inference_mode():
        ids, pos, meta, *_ = runner._prepare(step)
        assert model._native_step(model.embed(ids), meta)
        fused = model(ids, pos, meta, runner.kv.pool).float()
        fused_kv = runner.kv.pool.clone()
        runner.kv.pool.copy_(before_kv)
        native.use_kernels(model, "unfused")
        assert not model._native_step(model.embed(ids), meta)
        op_by_op = model(ids, pos, meta, runner.kv.pool).float()
        ids32, pos32, meta32, *_ = r32._prepare(step)
        exact = m32(ids32, pos32, meta32, r32.kv.pool)
    real = meta.num_real_tokens  # pad rows' hidden states are thrown away by the runner
    fused, op_by_op, exact = fused[:real], op_by_op[:real], exact[:real]
    assert not torch.equal(fused_kv, before_kv)  # the step wrote its K/V
    kv_diff = (fused_kv.float() - runner.kv.pool.float()).abs()
    assert kv_diff[0].max().item() <= 4e-3  # the first layer's K/V: one bf16 rounding of RoPE
    # later layers' K/V come from hidden states that differ by a few roundings (below): an ulp or two
    assert (kv_diff <= 2 ** -6 * runner.kv.pool.float().abs() + 4e-3).all()
    # a few bf16 rounding steps of each value (summation orders differ, and the prompt attention
    # rounds its weights to bf16 for the values' dot products, so a rounding upstream can move one),
    # and no further from fp32 (the bound that matters: the line after)
    assert ((fused - op_by_op).abs() <= 2 ** -4 * op_by_op.abs() + 1e-2).all()
    assert (fused - exact).abs().max().item() <= 1.25 * (op_by_op - exact).abs().max().item() + 5e-3


@needs_bf16
@pytest.mark.parametrize("kind", list(STEPS))
def test_widened_step_matches_the_dot_product_step(kind, monkeypatch):
    """A step whose products widen the weights to fp32 FMAs (``native.wide_rows``, forced here for
    every step) gives the bf16 dot products' hidden states and K/V within bf16 rounding, and is as
    close to an fp32 run: the two ways a CPU picks between by size stay in step."""
    model, runner, step, (r32, m32) = _llama_setup(kind, "native", "native")
    before_kv = runner.kv.pool.clone()
    widened, forward = [], native.llama_forward  # which way each step went (the real call runs)
    monkeypatch.setattr(native, "llama_forward", lambda *a, **kw: (widened.append(kw["widen"]), forward(*a, **kw))[1])
    with torch.inference_mode():
        ids, pos, meta, *_ = runner._prepare(step)
        monkeypatch.setenv("ASERVE_WIDE_ROWS", "0")
        native.wide_rows.cache_clear()
        packed = model(ids, pos, meta, runner.kv.pool).float()
        packed_kv = runner.kv.pool.clone()
        runner.kv.pool.copy_(before_kv)
        monkeypatch.setenv("ASERVE_WIDE_ROWS", "1")
        native.wide_rows.cache_clear()
        wide = model(ids, pos, meta, runner.kv.pool).float()
        assert widened == [False, True]
        ids32, pos32, meta32, *_ = r32._prepare(step)
        exact = m32(ids32, pos32, meta32, r32.kv.pool)
    native.wide_rows.cache_clear()
    real = meta.num_real_tokens
    wide, packed, exact = wide[:real], packed[:real], exact[:real]
    assert (packed_kv.float() - runner.kv.pool.float()).abs().max().item() <= 4e-3
    assert ((wide - packed).abs() <= 2 ** -5 * packed.abs() + 1e-2).all()
    assert (wide - exact).abs().max().item() <= 1.25 * (packed - exact).abs().max().item() + 5e-3


def test_wide_rows_is_measured_or_set(monkeypatch):
    """Unset, the cut is one of the sizes tried (or 0: never); ``ASERVE_WIDE_ROWS`` sets it, and a
    value that is not a row count is refused by name."""
    monkeypatch.delenv("ASERVE_WIDE_ROWS", raising=False)
    native.wide_rows.cache_clear()
    try:
        assert native.wide_rows(((96, 64), (64, 64)), 1) in (0, *native.WIDE_ROWS_TRIED)
        monkeypatch.setenv("ASERVE_WIDE_ROWS", "48")
        native.wide_rows.cache_clear()
        assert native.wide_rows(((96, 64),), 1) == 48
        monkeypatch.setenv("ASERVE_WIDE_ROWS", "many")
        native.wide_rows.cache_clear()
        with pytest.raises(ValueError, match="ASERVE_WIDE_ROWS"):
            native.wide_rows(((96, 64),), 1)
    finally:
        native.wide_rows.cache_clear()


@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("kernels,backend", [pytest.param("native", "native", marks=needs_bf16),
                                             pytest.param("unfused", "native", marks=needs_bf16),
                                             ("fallback", "sdpa"), ("fallback", "reference")])
def test_every_kernel_path_runs_a_bf16_step_close_to_fp32(kind, kernels, backend):
    """Every path a bf16 LLaMA step can take (ours in one call, ours op by op, torch's own ops)
    lands within a few bf16 roundings of the fp32 reference: the fallback is as good as ours."""
    model, runner, step, (r32, m32) = _llama_setup(kind, kernels, backend)
    with torch.inference_mode():
        ids, pos, meta, *_ = runner._prepare(step)
        assert model._native_step(model.embed(ids), meta) == (kernels == "native")
        real = meta.num_real_tokens
        hidden = model(ids, pos, meta, runner.kv.pool).float()[:real]
        ids32, pos32, meta32, *_ = r32._prepare(step)
        exact = m32(ids32, pos32, meta32, r32.kv.pool)[:real]
    assert ((hidden - exact).abs() <= 2 ** -4 * exact.abs() + 5e-2).all(), (hidden - exact).abs().max().item()


@needs_bf16
@pytest.mark.parametrize("chunks", [[(0, 1)], [(0, 40)], [(0, 16), (30, 33)], [(100, 7), (0, 200), (17, 16)]])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("layout", [(9, 3, 64), (8, 1, 32), (4, 4, 128)], ids=["9q-3kv-64", "8q-1kv-32", "4q-4kv-128"])
def test_paged_prefill_matches_dense_causal(chunks, block_size, layout):
    """Prompt chunks (from position 0 or continuing earlier chunks; lengths under, at and over the
    kernel's 16-query blocks) attend causally to their request's cached keys: against a dense
    fp32 computation, one request at a time. Head layouts: the default model's (a block's 48 query
    heads fill three groups of 16 lanes), 8 query heads a KV head with head size 32, and one with
    head size 128 (a block's heads fill a group partly when its rows are few)."""
    g = torch.Generator().manual_seed(len(chunks) * block_size)
    heads, kv_heads, d = layout
    rep = heads // kv_heads
    ctxs = [before + n for before, n in chunks]
    nbs = [-(-c // block_size) for c in ctxs]
    k_cache = torch.randn(sum(nbs) + 2, block_size, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(sum(nbs) + 2, block_size, kv_heads, d, generator=g).bfloat16()
    ids = torch.randperm(sum(nbs) + 2, generator=g)
    tables = torch.zeros(len(chunks), max(nbs), dtype=torch.long)
    rows, seqs, off, start = [], [], 0, 0
    for i, ((before, n), nb) in enumerate(zip(chunks, nbs)):
        tables[i, :nb] = ids[off:off + nb]
        off += nb
        seqs.append((start, start + n, before + n))
        start += n
    q = (torch.randn(start, heads, d, generator=g) * 2).bfloat16()
    got = native.paged_prefill(q, k_cache, v_cache, torch.tensor(seqs), tables, 0.125).float()
    for i, (s, e, ctx) in enumerate(seqs):
        k = k_cache[tables[i]].reshape(-1, kv_heads, d)[:ctx].float().repeat_interleave(rep, dim=1)
        v = v_cache[tables[i]].reshape(-1, kv_heads, d)[:ctx].float().repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * 0.125
        pos = torch.arange(ctx - (e - s), ctx)
        scores = scores.masked_fill(torch.arange(ctx)[None, None, :] > pos[None, :, None], float("-inf"))
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        assert (got[s:e] - want).abs().max().item() <= 2e-2


@needs_native
def test_read_pass_reads_every_value():
    """The memory probe of ``bench engine`` reads (and sums) the whole buffer."""
    x = torch.arange(64 * 1000, dtype=torch.float32) % 7
    assert native.load().read_pass(x) == pytest.approx(x.sum().item())
    with pytest.raises(RuntimeError, match="multiple of 64"):
        native.load().read_pass(torch.ones(100))


@needs_native
def test_kernels_let_other_threads_run():
    """A kernel call lets the GIL go: with the instances, the length predictor and the event loop
    on threads of one process, a kernel that held it stalled them all (the online lm predictor
    ran 3.5x slower beside a decoding engine). While one long call runs on a helper thread, this
    thread's Python loop must keep turning; were the GIL held, its longest gap would be the call."""
    import math
    import threading
    import time

    g = torch.Generator().manual_seed(7)
    blocks, bs = 32, 16
    k_cache = torch.randn(8 * blocks, bs, 2, 64, generator=g)
    v_cache = torch.randn(8 * blocks, bs, 2, 64, generator=g)

    def inputs(batch):  # requests share the cache's blocks: the work grows with the batch, memory not
        tables = torch.arange(8 * blocks).view(8, blocks).repeat(batch // 8, 1)
        return (torch.randn(batch, 8, 64, generator=g), k_cache, v_cache, tables,
                torch.full((batch,), blocks * bs), 0.125)

    probe = inputs(8)
    native.paged_decode(*probe)  # warm: a cold first call (thread pool, page faults) overstated the time
    start = time.perf_counter()
    native.paged_decode(*probe)
    batch = 8 * math.ceil(0.3 / max(time.perf_counter() - start, 1e-4))  # one call of about 0.3 s
    args = inputs(batch)
    helper = threading.Thread(target=native.paged_decode, args=args)
    start = last = time.perf_counter()
    helper.start()
    longest = 0.0
    while helper.is_alive():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    call = time.perf_counter() - start
    assert call > 0.1, "the call was too short to tell"
    assert longest < 0.5 * call, f"this thread stood still {longest:.3f} s of a {call:.3f} s kernel call"


# ---- which kernels, and which build ------------------------------------------------------------

def test_kernels_setting_is_resolved_and_checked():
    from aserve.config import EngineConfig
    from model.attention import pick_backend

    assert native.resolve_kernels("fallback", "cpu") == "fallback"
    assert native.resolve_kernels("auto", "cuda") == "fallback"  # ours are CPU kernels
    assert native.resolve_kernels("auto", "cpu") == ("native" if native.available() else "fallback")
    with pytest.raises(ValueError, match="bad kernels 'fast'"):
        native.resolve_kernels("fast", "cpu")
    with pytest.raises(ValueError, match="on cuda use auto or fallback"):
        native.resolve_kernels("native", "cuda")
    assert pick_backend("auto", "cpu", native_ok=False) == "sdpa"
    with pytest.raises(ValueError, match="kernels 'fallback' turns off"):
        pick_backend("native", "cpu", native_ok=False)
    assert EngineConfig(kernels="fallback").kernels == "fallback"
    with pytest.raises(ValueError, match="bad kernels 'x': choose one of auto, native, unfused, fallback"):
        EngineConfig(kernels="x")
    with pytest.raises(ValueError, match="kernels 'fallback' turns off"):
        EngineConfig(kernels="fallback", attention="native")


def test_build_is_named_after_the_instruction_set():
    """``-march=native`` code from one CPU may not run on another (SIGILL): the build's name carries
    a key of what it was compiled for, so another CPU (or compiler) gets a build of its own."""
    avx512 = "#define __AVX2__ 1\n#define __AVX512F__ 1"
    assert native.isa_key(avx512) == native.isa_key(avx512) and len(native.isa_key(avx512)) == 12
    assert native.isa_key(avx512) != native.isa_key(avx512 + "\n#define __AVX512BF16__ 1")
    assert native.build_name().startswith(f"{native._VERSION}_{native.isa_key(native._native_target())}_")


def test_profiles_name_the_kernels_by_their_source_text(tmp_path):
    """A saved device profile is measured again when the kernels it timed change: it names them
    by a digest of their sources, so an edit that leaves ``_VERSION`` alone (as the k-chunk
    products did) still makes the old profile stale."""
    from aserve.profiles.device_profile import identity

    copies = []
    for src in native._SOURCES + native._HEADERS:
        copy = tmp_path / Path(src).name
        copy.write_bytes(Path(src).read_bytes())
        copies.append(copy)
    assert native.sources_digest(copies) == native.sources_digest()
    copies[0].write_bytes(copies[0].read_bytes() + b"// one more line\n")
    assert native.sources_digest(copies) != native.sources_digest()
    assert identity()["kernels_build"] == f"{native._VERSION}+{native.sources_digest()}"


@needs_native
def test_a_build_killed_half_way_does_not_block_the_next_start(tmp_path):
    """torch's build lock is a file only its creator removes: a build killed while it compiled (a
    test's server stopped early, a Ctrl-C) used to leave every later start waiting on it forever
    (CI ran out of its 90 minutes so). A leftover lock in the build folder is now cleared by the
    next builder, which holds the OS lock that says no one else is building."""
    import os
    import shutil
    import subprocess
    import sys

    ext = tmp_path / "ext"
    ours = native.build_directory()
    there = ext / "aserve" / ours.name
    shutil.copytree(ours, there, ignore=shutil.ignore_patterns("lock"))  # the build, not recompiled
    (there / "lock").touch()  # what a killed build leaves behind
    code = "from model import native; native.load(); print('loaded')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}, cwd=str(native._CSRC.parents[1]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "loaded" and not (there / "lock").exists()


@needs_native
def test_the_loaded_build_is_this_cpus():
    from pathlib import Path

    assert Path(native.load().__file__).parent.name == native.build_name()



def test_a_machine_without_a_compiler_falls_back_and_says_why(tmp_path):
    """No C++ compiler (CXX names none, no cached build): auto resolves to torch's own ops, and the
    line ``aserve serve`` prints names the missing compiler (README, a fresh machine)."""
    import os
    import subprocess
    import sys

    code = ("from model import native; from aserve.config import EngineConfig; "
            "from aserve.commands.serve import _kernels_line; "
            "print(native.resolve_kernels('auto', 'cpu')); print(_kernels_line('fallback', EngineConfig()))")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    resolved, line = out.stdout.splitlines()
    assert resolved == "fallback"
    assert line.startswith("fallback (torch's own ops") and "no C++ compiler" in line and "no-such-c++" in line
