// The small per-row ops of an fp32 model's step, one call each instead of torch's several: on a
// CPU without AVX512-BF16 the model runs in fp32 through the Python layers (the whole-step
// llama_forward is bf16), and there torch's RMSNorm took 190 us a call at 8 rows (pow, mean, add,
// rsqrt, mul: 12 ms of a decode step's 61 norms on a 2-core Zen 3) and RoPE five ops a layer.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ASERVE_F32_OPS_AVX2 1
#endif

namespace {
// sum of squares of n floats, in float (8 lanes where AVX2 is there)
float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#ifdef ASERVE_F32_OPS_AVX2
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
    a = _mm256_fmadd_ps(u, u, a);
    b = _mm256_fmadd_ps(v, v, b);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(a, b));
  for (float l : lanes) total += l;
#endif
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}
}  // namespace

torch::Tensor rms_norm_f32(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.device().is_cpu(),
              "rms_norm_f32: fp32 CPU tensors");
  const int64_t D = w.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == D, "rms_norm_f32: x's last dimension must be w's size");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t rows = xc.numel() / D;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * D;
      float* yr = yp + r * D;
      const float inv = 1.f / std::sqrt(sum_squares(xr, D) / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * inv * wp[i];
    }
  });
  return y;
}

torch::Tensor rope_f32(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "rope_f32: x [T, heads, D] fp32");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rope_f32: an even head size");
  const auto c = cos.contiguous().view({-1, D}), s = sin.contiguous().view({-1, D});
  TORCH_CHECK(c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat && c.size(0) == T && s.size(0) == T,
              "rope_f32: cos and sin [T, D] fp32");
  const auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T * H, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H;
      const float *xr = xp + i * D, *cr = cp + t * D, *sr = sp + t * D;
      float* yr = yp + i * D;
      // rotate half: the sin table is signed (-sin on the first half), so both halves are adds
      for (int64_t j = 0; j < half; ++j) yr[j] = xr[j] * cr[j] + xr[j + half] * sr[j];
      for (int64_t j = half; j < D; ++j) yr[j] = xr[j] * cr[j] + xr[j - half] * sr[j];
    }
  });
  return y;
}
