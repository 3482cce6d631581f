// Paged decode attention on the CPU: one query token per request, reading K/V straight out of
// the block pool (no gather copy). Decode attention is memory-bound, so the win over a
// gather + SDPA is reading every cached byte once instead of three times.
//
//   q        [B, H, D]                 this step's query of each request (after RoPE)
//   k/v      [num_blocks, BS, H_kv, D] one layer's slice of the pool
//   tables   [B, max_blocks] int64     block ids of each request
//   ctx_lens [B] int64                 tokens each request has in the cache (this one included)
//
// Work is split over (request, kv head) pairs; each pair serves its G = H / H_kv query heads,
// so every K/V row is read once for all heads of its group.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
void decode_kernel(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* ctx_lens, T* out,
                   int64_t B, int64_t H, int64_t H_kv, int64_t D, int64_t BS, int64_t max_blocks, float scale) {
  const int64_t G = H / H_kv;
  at::parallel_for(0, B * H_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, kf(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / H_kv, h = item % H_kv, n = ctx_lens[b];
      scores.assign(G * n, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(q[(b * H + h * G + g) * D + d]) * scale;
      for (int64_t t = 0; t < n; ++t) {  // pass 1: scores = q . k
        const T* kr = k + ((tables[b * max_blocks + t / BS] * BS + t % BS) * H_kv + h) * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(kr[d]);
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
          const float* qg = qf.data() + g * D;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * n + t] = s;
        }
      }
      std::vector<float> inv_sum(G);
      for (int64_t g = 0; g < G; ++g) {  // softmax over each head's row
        float* row = scores.data() + g * n;
        const float m = *std::max_element(row, row + n);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) { row[t] = std::exp(row[t] - m); sum += row[t]; }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {  // pass 2: out = p . v
        const T* vr = v + ((tables[b * max_blocks + t / BS] * BS + t % BS) * H_kv + h) * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(vr[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * kf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && ctx_lens.scalar_type() == torch::kLong, "int64 tables");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  auto t = tables.contiguous();
  auto c = ctx_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), H_kv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % H_kv == 0, "head dims do not match");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            t.data_ptr<int64_t>(), c.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, H_kv, D,
                            BS, t.size(1), static_cast<float>(scale));
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }
