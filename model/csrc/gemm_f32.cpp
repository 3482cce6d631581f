// fp32 matrix products over weights packed once at load time (pack_f32's layout), with AVX2 FMAs:
// the small-row products of an fp32 model on CPUs without AVX512-BF16 (an AMD EPYC Zen 3, a
// Xeon without BF16), where the model runs in fp32 and torch's own product is the only other way.
//
// torch's fp32 product (MKL's sgemm) packs the weight for every call: on a 2-core Zen 3 the
// default model's 121 products of a decode step took 60 ms at 1 row (9 GB/s of weights) and
// 173 ms at 8 rows (3.1 GB/s), against a memory read of the same 540 MB well above that. Here
// the weight is packed once, as for the bf16 products (gemm_bf16.cpp): groups of 64 outputs,
// one k a step, [G, K, 64] fp32. A unit is half a group, 32 outputs: four ymm of sums a row,
// at most three rows a block (12 sums, 3 broadcasts, one weight register: the 16 ymm of AVX2),
// the half's 128 bytes a k read front to back once a block (the first block from memory, asked
// into L2 kPrefetchBytes ahead; the later blocks from L2). Each output's sum runs over k in
// order, one FMA a k.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ASERVE_F32_FMA 1
#endif

namespace {
constexpr int64_t kGroup = 32;   // outputs a packed group (pack_f32x32): four ymm
constexpr int kMaxRows = 3;      // x rows a block
constexpr int64_t kAhead = 4096 / (kGroup * 4);  // k steps the first block asks into L2 ahead (4 KiB)
constexpr int64_t kChunk = 128;  // k steps a chunk (16 KiB of weights): every block of rows runs over it in L1

#ifdef ASERVE_F32_FMA
// Rows m0 .. m0 + MB of x [M, K] times a group's k steps [k0, k1): sums (4 ymm a row) started from
// part (rows kGroup apart) unless first, and stored back into part.
template <int MB>
__attribute__((always_inline)) inline void block(const float* x, int64_t K, const float* w, int64_t k0, int64_t k1,
                                                 float* part, bool first, bool prefetch) {
  __m256 acc[MB][4];
#pragma GCC unroll 3
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t)
      acc[m][t] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + m * kGroup + 8 * t);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * kGroup;
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * kGroup), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * kGroup + 16), _MM_HINT_T1);
    }
    __m256 xb[MB];
#pragma GCC unroll 3
    for (int m = 0; m < MB; ++m) xb[m] = _mm256_broadcast_ss(x + m * K + k);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m256 wt = _mm256_load_ps(wk + 8 * t);
#pragma GCC unroll 3
      for (int m = 0; m < MB; ++m) acc[m][t] = _mm256_fmadd_ps(wt, xb[m], acc[m][t]);
    }
  }
#pragma GCC unroll 3
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) _mm256_storeu_ps(part + m * kGroup + 8 * t, acc[m][t]);
}

// Every row of x times group g: in k-chunks, every block of up to three rows over a chunk before
// the next (the first block reads the chunk from memory, the others from L1), the sums kept in
// part [M, 32] between chunks; then bias and the outputs past N dropped, into y [M, N].
void run_group(const float* x, int64_t M, int64_t K, const float* packed, int64_t N, const float* bias, float* y,
               int64_t g, float* part) {
  const float* w = packed + g * K * kGroup;
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    int64_t m = 0;
    for (; m + kMaxRows <= M; m += kMaxRows)
      block<kMaxRows>(x + m * K, K, w, k0, k1, part + m * kGroup, k0 == 0, m == 0);
    if (M - m == 2) block<2>(x + m * K, K, w, k0, k1, part + m * kGroup, k0 == 0, m == 0);
    if (M - m == 1) block<1>(x + m * K, K, w, k0, k1, part + m * kGroup, k0 == 0, m == 0);
  }
  const int64_t n0 = g * kGroup, valid = std::min(kGroup, N - n0);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = 0; i < valid; ++i) y[r * N + n0 + i] = part[r * kGroup + i] + (bias ? bias[n0 + i] : 0.f);
}
#endif
}  // namespace

torch::Tensor pack_f32x32(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "pack_f32x32: w must be [N, K] fp32 or bf16");
  const auto wc = w.contiguous().to(at::kFloat);
  const int64_t N = wc.size(0), K = wc.size(1), G = (N + kGroup - 1) / kGroup;
  auto out = torch::zeros({G, K, kGroup}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < kGroup && g * kGroup + r < N; ++r)
        for (int64_t k = 0; k < K; ++k) dst[(g * K + k) * kGroup + r] = src[(g * kGroup + r) * K + k];
  });
  return out;
}

bool has_f32_linear() {
#ifdef ASERVE_F32_FMA
  return true;
#else
  return false;
#endif
}

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor packed, int64_t n, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(has_f32_linear(), "linear_f32 needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be [M, K] fp32 on the CPU");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kGroup && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "not an fp32-packed weight (see pack_f32x32)");
  TORCH_CHECK(x.size(1) == packed.size(1), "x has ", x.size(1), " columns, the packed weight ", packed.size(1));
  TORCH_CHECK(n > 0 && n <= packed.size(0) * kGroup, "bad output count ", n);
  const auto xc = x.contiguous();
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "linear_f32: bias has ", b.numel(), " values for ", n, " outputs");
  }
  auto y = torch::empty({xc.size(0), n}, xc.options());
#ifdef ASERVE_F32_FMA
  const int64_t M = xc.size(0), K = xc.size(1), G = packed.size(0);
  if (M > 0) {
    const float* xp = xc.data_ptr<float>();
    const float* wp = packed.data_ptr<float>();
    const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      std::vector<float> part(static_cast<size_t>(M * kGroup));
      for (int64_t g = g0; g < g1; ++g) run_group(xp, M, K, wp, n, bp, yp, g, part.data());
    });
  }
#endif
  return y;
}
