// One forward step of a LLaMA-family model in bf16 through all its layers in a single call:
// any mix of prompt chunks and decode tokens (and TetriInfer's pad rows).
//
// At batch 1 a decode step of the 135M default model reads ~270 MB of weights, and the ~25 small
// torch ops per layer that Python dispatched one by one (norms, RoPE, the KV write, residual
// adds, SiLU*up, splits and views) used to cost about as much again; in a prompt chunk the same
// ops, torch's unfused bf16 RMSNorm and SDPA took a third of the step. Here each layer is four
// packed bf16 products (gemm_bf16.cpp), the two attention kernels, and short loops:
//
//   normed = rms_norm(h)                      vectorised, fp32 sums
//   qkv    = normed @ Wqkv                    packed product
//   q, K, V <- RoPE(qkv); K/V into the pool   fp32 tables, rounded once (real rows only)
//   attn   = prompt chunks: paged_prefill_bf16, decode tokens: paged_decode; pad rows 0
//   h     += attn @ Wo                        product and residual add in one pass
//   normed = rms_norm(h)
//   act    = silu(normed @ Wg) * (normed @ Wu)   one product, SwiGLU in its epilogue
//   h     += act @ Wdown                      product and residual add in one pass
//
// Numerics follow the op-by-op bf16 path: every op's result is rounded to bf16 where torch
// rounds it (the products' outputs before the residual add, silu before the multiply), except
// RoPE, which is computed in fp32 from fp32 tables and rounded once.
//
// Rows of x are laid out as the runner lays out a step (model/attention.py):
//   [ prompt chunk 0 | chunk 1 | ... | decode token 0 | ... | pad ... ]
//
//   x          [T, E] bf16: the step's embedded tokens
//   cos, sin   [T, D] fp32: RoPE tables at each token's position (sin signed: cat(-sin, sin))
//   layers     6 per layer: attn_norm [E], qkv packed ((H + 2 H_kv) D outputs), o packed (E),
//              mlp_norm [E], gate_up packed in gate-up order (I outputs), down packed (E)
//   final_norm [E]
//   kv         [L, 2, num_blocks, BS, H_kv, D] bf16: the pool; this step's K/V is written at
//   slots      [N] int64 flat slot of each real (not pad) token
//   seqs       [P, 3] int64: each prompt chunk's first row, end row and context length after it
//   seq_tables [P, max_blocks] int64 block ids of each chunk's request
//   dec_tables [B, max_blocks'] int64, dec_lens [B] int64 (this token included): decode rows,
//              which follow the chunks' rows
//   tap_layer  0, or a layer count k: also return tap_rows' hidden states after k layers, through
//              the final RMSNorm (what the first k layers as a model of their own would output:
//              the `lm` length predictor's features, taken from the served prefill for free)
//   returns    [T, E] bf16: the final RMSNorm of the last layer's output; and the taps [R, E]
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>

namespace {
using bf16 = c10::BFloat16;

#if defined(__AVX512F__)
inline void narrow16(bf16* p, __m512 v) {  // round to nearest even, as c10::BFloat16(float)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
#endif

// rows of a prompt chunk go to the threads in runs of kRowGrain (a decode step's few rows stay on
// the calling thread); each row is computed the same on any thread
constexpr int64_t kRowGrain = 32;

void rms_norm_rows(const bf16* x, const bf16* w, bf16* y, int64_t t0, int64_t t1, int64_t E, float eps) {
  for (int64_t t = t0; t < t1; ++t) {
    const bf16* xr = x + t * E;
    bf16* yr = y + t * E;
#if defined(__AVX512F__)
    if (E % 16 == 0) {
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < E; i += 16) {
        const __m512 v = widen16(xr + i);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(E) + eps));
      for (int64_t i = 0; i < E; i += 16)
        narrow16(yr + i, _mm512_mul_ps(_mm512_mul_ps(widen16(xr + i), inv), widen16(w + i)));
      continue;
    }
#endif
    float ss = 0.f;
    for (int64_t i = 0; i < E; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(E) + eps);
    for (int64_t i = 0; i < E; ++i) yr[i] = bf16(static_cast<float>(xr[i]) * inv * static_cast<float>(w[i]));
  }
}

void rms_norm(const bf16* x, const bf16* w, bf16* y, int64_t T, int64_t E, float eps) {
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) { rms_norm_rows(x, w, y, t0, t1, E, eps); });
}

// rotate-half RoPE of one head: out = x * cos + cat(x2, x1) * signed_sin
void rope_head(const bf16* x, const float* cos, const float* sin, bf16* out, int64_t D) {
  const int64_t half = D / 2;
#if defined(__AVX512F__)
  if (half % 16 == 0) {
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 a = widen16(x + i), b = widen16(x + half + i);
      narrow16(out + i, _mm512_fmadd_ps(b, _mm512_loadu_ps(sin + i), _mm512_mul_ps(a, _mm512_loadu_ps(cos + i))));
      narrow16(out + half + i, _mm512_fmadd_ps(a, _mm512_loadu_ps(sin + half + i),
                                               _mm512_mul_ps(b, _mm512_loadu_ps(cos + half + i))));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
    out[i] = bf16(a * cos[i] + b * sin[i]);
    out[i + half] = bf16(b * cos[i + half] + a * sin[i + half]);
  }
}
}  // namespace

std::vector<torch::Tensor> llama_forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                         std::vector<torch::Tensor> layers, torch::Tensor final_norm, torch::Tensor kv,
                                         torch::Tensor slots, torch::Tensor seqs, torch::Tensor seq_tables,
                                         torch::Tensor dec_tables, torch::Tensor dec_lens, int64_t num_heads, double eps,
                                         double scale, int64_t tap_layer, torch::Tensor tap_rows, bool widen) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "llama_forward: x [T, E] bf16 CPU");
  TORCH_CHECK(kv.dim() == 6 && kv.scalar_type() == at::kBFloat16 && kv.is_contiguous(), "llama_forward: kv pool");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "llama_forward: fp32 RoPE tables");
  const int64_t L = kv.size(0), BS = kv.size(3), H_kv = kv.size(4), D = kv.size(5);
  const int64_t T = x.size(0), E = x.size(1), H = num_heads, N = slots.numel(), B = dec_lens.numel();
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == 6 * L, "llama_forward: 6 weights per layer");
  TORCH_CHECK(cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes(), "llama_forward: RoPE tables [T, D]");
  TORCH_CHECK(N <= T && dec_tables.size(0) == B && seqs.size(0) == seq_tables.size(0), "llama_forward: step layout");
  TORCH_CHECK(D % 2 == 0 && H % H_kv == 0, "llama_forward: head layout");
  TORCH_CHECK(tap_layer >= 0 && tap_layer <= L && tap_rows.scalar_type() == at::kLong, "llama_forward: tap");
  const int64_t num_prefill = N - B;  // rows of prompt chunks, then B decode rows
  TORCH_CHECK(num_prefill >= 0 && (seqs.size(0) == 0 || seqs[-1][1].item<int64_t>() == num_prefill),
              "llama_forward: the chunks' rows must come first and end where the decode rows start");
  const auto cosc = cos.contiguous(), sinc = sin.contiguous(), slotc = slots.contiguous();
  const float* cp = cosc.data_ptr<float>();
  const float* sp = sinc.data_ptr<float>();
  const int64_t* slot = slotc.data_ptr<int64_t>();
  const int64_t qkv_width = (H + 2 * H_kv) * D;
  for (int64_t t = 0; t < N; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < kv.size(2) * BS, "llama_forward: slot out of the pool");

  auto h = x.contiguous().clone();  // the residual stream
  auto normed = torch::empty_like(h);
  auto q = torch::empty({N, H, D}, h.options());
  auto attn = torch::zeros({T, H, D}, h.options());  // pad rows stay 0, as in the op-by-op path
  bf16* hp = h.data_ptr<bf16>();
  bf16* np = normed.data_ptr<bf16>();
  bf16* qp = q.data_ptr<bf16>();
  const float fe = static_cast<float>(eps);
  auto taps = torch::empty({tap_layer > 0 ? tap_rows.numel() : 0, E}, h.options());

  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = layers.data() + 6 * l;
    auto k_cache = kv[l][0], v_cache = kv[l][1];  // [num_blocks, BS, H_kv, D]
    bf16* kc = k_cache.data_ptr<bf16>();
    bf16* vc = v_cache.data_ptr<bf16>();

    rms_norm(hp, w[0].data_ptr<bf16>(), np, T, E, fe);
    const auto qkv = linear_packed(normed, w[1], qkv_width, std::nullopt, false, widen);
    const bf16* qkvp = qkv.data_ptr<bf16>();
    at::parallel_for(0, N, kRowGrain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const bf16* row = qkvp + t * qkv_width;
        const float *ct = cp + t * D, *st = sp + t * D;
        for (int64_t j = 0; j < H; ++j) rope_head(row + j * D, ct, st, qp + (t * H + j) * D, D);
        for (int64_t j = 0; j < H_kv; ++j) {
          rope_head(row + (H + j) * D, ct, st, kc + (slot[t] * H_kv + j) * D, D);
          std::copy_n(row + (H + H_kv + j) * D, D, vc + (slot[t] * H_kv + j) * D);
        }
      }
    });
    if (num_prefill > 0) {
      auto out = attn.narrow(0, 0, num_prefill);
      if (!paged_prefill_bf16(q.narrow(0, 0, num_prefill), k_cache, v_cache, seqs, seq_tables, scale, out))
        TORCH_CHECK(false, "llama_forward: no bf16 prefill attention for this head layout");
    }
    if (B > 0)
      attn.narrow(0, num_prefill, B).copy_(paged_decode(q.narrow(0, num_prefill, B), k_cache, v_cache, dec_tables,
                                                        dec_lens, scale));
    linear_packed_add_(h, attn.view({T, H * D}), w[2], widen);

    rms_norm(hp, w[3].data_ptr<bf16>(), np, T, E, fe);
    linear_packed_add_(h, silu_mul_packed(normed, w[4], widen), w[5], widen);
    if (l + 1 == tap_layer) {  // the tapped rows after this layer, normed as a truncated model's output
      const auto rows = h.index_select(0, tap_rows.contiguous());
      rms_norm(rows.data_ptr<bf16>(), final_norm.data_ptr<bf16>(), taps.data_ptr<bf16>(), rows.size(0), E, fe);
    }
  }
  auto out = torch::empty_like(h);
  rms_norm(hp, final_norm.data_ptr<bf16>(), out.data_ptr<bf16>(), T, E, fe);
  return {out, taps};
}
