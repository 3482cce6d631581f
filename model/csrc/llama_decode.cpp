// One decode-only step of a LLaMA-family model through all its layers in a single call.
//
// At batch 1 a step of the 135M default model reads ~270 MB of weights (~7 ms on this machine)
// but used to spend about as long again in the ~25 small torch ops per layer that Python
// dispatched one by one (norms, RoPE, the KV write, residual adds, SiLU*up, splits and views).
// Here the elementwise work runs as plain loops between the big pieces, which are the same
// kernels the op-by-op path uses: our weight-streaming linear (torch's matmul above its row
// limit, as model.native.linear decides) and our paged decode attention.
//
// Numerics follow the op-by-op bf16 path: every op's result is rounded to bf16 where torch
// rounds it, except RoPE, which is computed in fp32 from fp32 tables and rounded once.
//
//   x          [T, E] bf16: the step's embedded tokens, one per request
//   cos, sin   [T, D] fp32: RoPE tables at each token's position (sin signed: cat(-sin, sin))
//   layers     6 per layer: attn_norm [E], qkv [(H + 2 H_kv) D, E], o [E, H D],
//              mlp_norm [E], gate_up [2 I, E], down [E, I] (all bf16, no biases)
//   final_norm [E]
//   kv         [L, 2, num_blocks, BS, H_kv, D] bf16: the pool; this step's K/V is written at
//   slots      [T] int64 flat slot of each token
//   tables     [T, max_blocks] int64, ctx_lens [T] int64 (this token included)
//   returns    [T, E] bf16: the final RMSNorm of the last layer's output
#include "kernels.h"

#include <c10/util/BFloat16.h>

#include <cmath>

namespace {
using bf16 = c10::BFloat16;

// our weight-streaming linear up to ``native_rows`` rows (model.native passes its own limit, 0 when
// ASERVE_NATIVE_LINEAR=0), torch's matmul above: the choice model.native.linear makes
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, int64_t native_rows) {
  if (x.size(0) <= native_rows && has_bf16_linear()) return linear_bf16(x, w, std::nullopt);
  return at::linear(x, w);
}

void rms_norm(const bf16* x, const bf16* w, bf16* y, int64_t T, int64_t E, float eps) {
  for (int64_t t = 0; t < T; ++t) {
    const bf16* xr = x + t * E;
    float ss = 0.f;
    for (int64_t i = 0; i < E; ++i) {
      const float v = static_cast<float>(xr[i]);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(E) + eps);
    for (int64_t i = 0; i < E; ++i) y[t * E + i] = bf16(static_cast<float>(xr[i]) * inv * static_cast<float>(w[i]));
  }
}

void add_into(bf16* x, const bf16* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = bf16(static_cast<float>(x[i]) + static_cast<float>(d[i]));
}

// rotate-half RoPE of one head: out = x * cos + cat(x2, x1) * signed_sin
void rope_head(const bf16* x, const float* cos, const float* sin, bf16* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
    out[i] = bf16(a * cos[i] + b * sin[i]);
    out[i + half] = bf16(b * cos[i + half] + a * sin[i + half]);
  }
}
}  // namespace

torch::Tensor llama_decode(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> layers,
                           torch::Tensor final_norm, torch::Tensor kv, torch::Tensor slots, torch::Tensor tables,
                           torch::Tensor ctx_lens, int64_t num_heads, double eps, double scale,
                           int64_t native_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "llama_decode: x [T, E] bf16 CPU");
  TORCH_CHECK(kv.dim() == 6 && kv.scalar_type() == at::kBFloat16 && kv.is_contiguous(), "llama_decode: kv pool");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "llama_decode: fp32 RoPE tables");
  const int64_t L = kv.size(0), BS = kv.size(3), H_kv = kv.size(4), D = kv.size(5);
  const int64_t T = x.size(0), E = x.size(1), H = num_heads;
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == 6 * L, "llama_decode: 6 weights per layer");
  TORCH_CHECK(cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes(), "llama_decode: RoPE tables [T, D]");
  TORCH_CHECK(slots.numel() == T && ctx_lens.numel() == T && tables.size(0) == T, "llama_decode: one slot per token");
  TORCH_CHECK(D % 2 == 0 && H % H_kv == 0, "llama_decode: head layout");
  const auto cosc = cos.contiguous(), sinc = sin.contiguous(), slotc = slots.contiguous();
  const float* cp = cosc.data_ptr<float>();
  const float* sp = sinc.data_ptr<float>();
  const int64_t* slot = slotc.data_ptr<int64_t>();
  const int64_t qkv_width = (H + 2 * H_kv) * D;

  auto h = x.contiguous().clone();  // the residual stream
  auto normed = torch::empty_like(h);
  auto q = torch::empty({T, H, D}, h.options());
  bf16* hp = h.data_ptr<bf16>();
  bf16* np = normed.data_ptr<bf16>();
  bf16* qp = q.data_ptr<bf16>();
  const int64_t I = layers[4].size(0) / 2;  // SwiGLU width, the same in every layer
  auto act = torch::empty({T, I}, h.options());
  bf16* ap = act.data_ptr<bf16>();
  const float fe = static_cast<float>(eps);

  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = layers.data() + 6 * l;
    TORCH_CHECK(w[1].size(0) == qkv_width && w[1].size(1) == E, "llama_decode: qkv weight of layer ", l);
    auto k_cache = kv[l][0], v_cache = kv[l][1];  // [num_blocks, BS, H_kv, D]
    bf16* kc = k_cache.data_ptr<bf16>();
    bf16* vc = v_cache.data_ptr<bf16>();

    rms_norm(hp, w[0].data_ptr<bf16>(), np, T, E, fe);
    const auto qkv = project(normed, w[1], native_rows);
    const bf16* qkvp = qkv.data_ptr<bf16>();
    for (int64_t t = 0; t < T; ++t) {
      const bf16* row = qkvp + t * qkv_width;
      const float *ct = cp + t * D, *st = sp + t * D;
      TORCH_CHECK(slot[t] >= 0 && slot[t] < k_cache.size(0) * BS, "llama_decode: slot out of the pool");
      for (int64_t j = 0; j < H; ++j) rope_head(row + j * D, ct, st, qp + (t * H + j) * D, D);
      for (int64_t j = 0; j < H_kv; ++j) {
        rope_head(row + (H + j) * D, ct, st, kc + (slot[t] * H_kv + j) * D, D);
        std::copy_n(row + (H + H_kv + j) * D, D, vc + (slot[t] * H_kv + j) * D);
      }
    }
    const auto attn = paged_decode(q, k_cache, v_cache, tables, ctx_lens, scale);
    const auto o = project(attn.view({T, H * D}), w[2], native_rows);
    add_into(hp, o.data_ptr<bf16>(), T * E);

    rms_norm(hp, w[3].data_ptr<bf16>(), np, T, E, fe);
    const auto gu = project(normed, w[4], native_rows);
    TORCH_CHECK(gu.size(1) == 2 * I, "llama_decode: gate_up weight of layer ", l);
    const bf16* gup = gu.data_ptr<bf16>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < I; ++i) {
        const float g = static_cast<float>(gup[t * 2 * I + i]);
        const float s = static_cast<float>(bf16(g / (1.f + std::exp(-g))));
        ap[t * I + i] = bf16(s * static_cast<float>(gup[t * 2 * I + I + i]));
      }
    const auto down = project(act, w[5], native_rows);
    add_into(hp, down.data_ptr<bf16>(), T * E);
  }
  auto out = torch::empty_like(h);
  rms_norm(hp, final_norm.data_ptr<bf16>(), out.data_ptr<bf16>(), T, E, fe);
  return out;
}
