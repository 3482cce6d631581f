// A weight-streaming bf16 linear for decode-sized batches on CPUs with AVX512-BF16.
//
// At a decode step the linear layers see a handful of rows (one per request) against weights
// that do not fit in cache, so the step costs one pass over the weights: the kernel is only as
// fast as its reads. torch's bf16 matmul reaches about a quarter of the machine's bandwidth at
// M = 1 here; this one walks W once, four output rows at a time, and multiplies every row of x
// against each W tile while it sits in L1 (vdpbf16ps: pairs of bf16 products summed in fp32),
// prefetching the weights a few KiB ahead of the tile it is on.
//
//   x [M, K] bf16 (K a multiple of 32), w [N, K] bf16, bias [N] (any float dtype) or none
//   returns [M, N] bf16, each value rounded once from its fp32 sum
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define ASERVE_BF16_DP 1
#endif

namespace {
constexpr int64_t kRowsPerTile = 4;
// Software prefetch distance. The hardware prefetcher alone kept one core at ~16 GB/s on this
// machine (AMD EPYC); asking 4 KiB ahead raised the two cores from 28 to 38 GB/s over the default
// model's weights (2-8 KiB measured the same; 1 KiB less).
constexpr int64_t kPrefetchBytes = 4096;

#ifdef ASERVE_BF16_DP
void linear_rows(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, c10::BFloat16* y, int64_t M,
                 int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t kv = K / 32;
  for (int64_t n = n0; n < n1; n += kRowsPerTile) {
    const int64_t rows = std::min(kRowsPerTile, n1 - n);
    const __m512bh* wr[kRowsPerTile];
    for (int64_t r = 0; r < kRowsPerTile; ++r)
      wr[r] = reinterpret_cast<const __m512bh*>(w + (n + std::min(r, rows - 1)) * K);
    for (int64_t m = 0; m < M; ++m) {
      const __m512bh* xm = reinterpret_cast<const __m512bh*>(x + m * K);
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps(),
             acc3 = _mm512_setzero_ps();
      for (int64_t c = 0; c < kv; ++c) {
        if (m == 0)  // the first pass over the tile asks for the weights kPrefetchBytes ahead
          for (int64_t r = 0; r < kRowsPerTile; ++r)
            _mm_prefetch(reinterpret_cast<const char*>(wr[r] + c) + kPrefetchBytes, _MM_HINT_T0);
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xm + c);
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(wr[0] + c), xv);
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(wr[1] + c), xv);
        acc2 = _mm512_dpbf16_ps(acc2, (__m512bh)_mm512_loadu_si512(wr[2] + c), xv);
        acc3 = _mm512_dpbf16_ps(acc3, (__m512bh)_mm512_loadu_si512(wr[3] + c), xv);
      }
      const float s[kRowsPerTile] = {_mm512_reduce_add_ps(acc0), _mm512_reduce_add_ps(acc1),
                                     _mm512_reduce_add_ps(acc2), _mm512_reduce_add_ps(acc3)};
      for (int64_t r = 0; r < rows; ++r)
        y[m * N + n + r] = c10::BFloat16(s[r] + (bias ? bias[n + r] : 0.f));
    }
  }
}
#endif
}  // namespace

bool has_bf16_linear() {
#ifdef ASERVE_BF16_DP
  return true;
#else
  return false;
#endif
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(has_bf16_linear(), "linear_bf16 needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_bf16: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bf16 only");
  TORCH_CHECK(x.size(1) % 32 == 0, "linear_bf16: K must be a multiple of 32");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "linear_bf16: bias has ", b.numel(), " values for ", N, " outputs");
  }
  auto y = torch::empty({M, N}, xc.options());
#ifdef ASERVE_BF16_DP
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  const auto* xp = xc.data_ptr<c10::BFloat16>();
  const auto* wp = wc.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t tiles = (N + kRowsPerTile - 1) / kRowsPerTile;
  // grain: at least 64 tiles (256 rows) per task, so small layers do not pay for threads they cannot use
  at::parallel_for(0, tiles, 64, [&](int64_t t0, int64_t t1) {
    linear_rows(xp, wp, bp, yp, M, N, K, t0 * kRowsPerTile, std::min(N, t1 * kRowsPerTile));
  });
#endif
  return y;
}
