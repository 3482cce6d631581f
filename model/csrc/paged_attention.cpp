// Paged decode attention on the CPU: one query token per request, reading K/V straight out of
// the block pool (no gather copy). Decode attention is memory-bound, so the win over a
// gather + SDPA is reading every cached byte once instead of three times.
//
//   q        [B, H, D]                 this step's query of each request (after RoPE)
//   k/v      [num_blocks, BS, H_kv, D] one layer's slice of the pool
//   tables   [B, max_blocks] int64     block ids of each request
//   ctx_lens [B] int64                 tokens each request has in the cache (this one included)
//
// bf16 caches with a common head layout take the fast path of paged_decode_bf16.cpp. The
// general paths here split the work over (request, kv head) pairs; each pair serves its
// G = H / H_kv query heads, so every K/V row is read once for all heads of its group. With
// AVX-512 (and a head size that is a multiple of 16) rows are widened to fp32 in registers and
// the softmax is exponentiated 16 lanes at a time; with AVX2 alone (a multiple of 8), 8 lanes at
// a time; elsewhere a scalar loop does the same sums.
//
// This file also defines the Python module, which holds the kernels of the other files.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define ASERVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ASERVE_AVX2 1
#endif

namespace {

// One thread's buffers, sized once and reused for every (request, kv head) item it serves:
// qf the group's scaled queries in fp32, acc their outputs, scores their softmax rows.
struct Scratch {
  std::vector<float> qf, acc, kf, inv_sum, scores;

  template <typename T>
  void start(const T* q, int64_t G, int64_t D, int64_t n, float scale) {
    qf.resize(G * D);
    acc.assign(G * D, 0.f);
    kf.resize(D);
    inv_sum.resize(G);
    scores.resize(G * n);
    for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  }
};

// Scalar path: any head size, any build.
template <typename T>
void decode_item_scalar(const T* q, const T* k, const T* v, const int64_t* table, int64_t n, T* out, int64_t h,
                        int64_t H_kv, int64_t G, int64_t D, int64_t BS, float scale, Scratch& buf) {
  buf.start(q, G, D, n, scale);
  std::vector<float>&qf = buf.qf, &acc = buf.acc, &kf = buf.kf, &scores = buf.scores, &inv_sum = buf.inv_sum;
  for (int64_t t = 0; t < n; ++t) {  // pass 1: scores = q . k
    const T* kr = k + ((table[t / BS] * BS + t % BS) * H_kv + h) * D;
    for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(kr[d]);
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * kf[d];
      scores[g * n + t] = s;
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // softmax over each head's row
    float* row = scores.data() + g * n;
    const float m = *std::max_element(row, row + n);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) { row[t] = std::exp(row[t] - m); sum += row[t]; }
    inv_sum[g] = 1.f / sum;
  }
  for (int64_t t = 0; t < n; ++t) {  // pass 2: out = p . v
    const T* vr = v + ((table[t / BS] * BS + t % BS) * H_kv + h) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + t];
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * static_cast<float>(vr[d]);
    }
  }
  for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(acc[i] * inv_sum[i / D]);
}

#ifdef ASERVE_AVX512
constexpr int64_t kMaxVec = 16;  // head sizes up to 256 on the vector path

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) { return widen16(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Vector path: D a multiple of 16. K and V rows are widened to fp32 in registers, once per
// row for all G query heads of the group; the softmax row is exponentiated 16 lanes at a time.
template <typename T>
void decode_item_avx512(const T* q, const T* k, const T* v, const int64_t* table, int64_t n, T* out, int64_t h,
                        int64_t H_kv, int64_t G, int64_t D, int64_t BS, float scale, Scratch& buf) {
  const int64_t nv = D / 16;
  buf.start(q, G, D, n, scale);
  std::vector<float>&qf = buf.qf, &acc = buf.acc, &scores = buf.scores, &inv_sum = buf.inv_sum;
  __m512 row[kMaxVec];
  for (int64_t t = 0; t < n; ++t) {  // pass 1: scores = q . k
    const T* kr = k + ((table[t / BS] * BS + t % BS) * H_kv + h) * D;
    for (int64_t j = 0; j < nv; ++j) row[j] = load16(kr + 16 * j);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf.data() + g * D;
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), row[0]);
      for (int64_t j = 1; j < nv; ++j) s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), row[j], s);
      scores[g * n + t] = _mm512_reduce_add_ps(s);
    }
  }
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1u);
  for (int64_t g = 0; g < G; ++g) {  // softmax over each head's row
    float* r = scores.data() + g * n;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < full; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(r + t));
    if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, r + full));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < full; t += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(r + t), m));
      _mm512_storeu_ps(r + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, r + full), m));
      _mm512_mask_storeu_ps(r + full, tail, e);
      sum = _mm512_mask_add_ps(sum, tail, sum, e);
    }
    inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum);
  }
  for (int64_t t = 0; t < n; ++t) {  // pass 2: out = p . v
    const T* vr = v + ((table[t / BS] * BS + t % BS) * H_kv + h) * D;
    for (int64_t j = 0; j < nv; ++j) row[j] = load16(vr + 16 * j);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * n + t]);
      float* ag = acc.data() + g * D;
      for (int64_t j = 0; j < nv; ++j)
        _mm512_storeu_ps(ag + 16 * j, _mm512_fmadd_ps(p, row[j], _mm512_loadu_ps(ag + 16 * j)));
    }
  }
  for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(acc[i] * inv_sum[i / D]);
}
#endif

#ifdef ASERVE_AVX2
// The vector path where the CPU has AVX2 and no AVX-512 (an fp32 model on an AMD Zen 3, whose
// scalar loops took 3.6 ms a layer for 8 rows at context 300: 108 ms of a 235 ms step): D a
// multiple of 8, rows widened to fp32 in ymm registers, the softmax exponentiated 8 lanes at a time.
constexpr int64_t kMaxVec8 = 32;  // head sizes up to 256

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// e^x, 8 lanes, for x <= 0 (a softmax row less its maximum): 2^(x log2 e) as an integer power
// (put into the exponent bits) times 2^f, f in [-0.5, 0.5], by exp16's polynomial (kExp2Poly).
// x is clamped at -87 (e^-87 ~ 1.6e-38, against a row sum of at least 1).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 7
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

template <typename T>
void decode_item_avx2(const T* q, const T* k, const T* v, const int64_t* table, int64_t n, T* out, int64_t h,
                      int64_t H_kv, int64_t G, int64_t D, int64_t BS, float scale, Scratch& buf) {
  const int64_t nv = D / 8;
  buf.start(q, G, D, n, scale);
  std::vector<float>&qf = buf.qf, &acc = buf.acc, &scores = buf.scores, &inv_sum = buf.inv_sum;
  __m256 row[kMaxVec8];
  for (int64_t t = 0; t < n; ++t) {  // pass 1: scores = q . k
    const T* kr = k + ((table[t / BS] * BS + t % BS) * H_kv + h) * D;
    for (int64_t j = 0; j < nv; ++j) row[j] = load8(kr + 8 * j);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf.data() + g * D;
      __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qg), row[0]), s1 = _mm256_setzero_ps();
      for (int64_t j = 1; j < nv; ++j) {
        if (j & 1) s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j), row[j], s1);
        else s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j), row[j], s0);
      }
      scores[g * n + t] = sum8(_mm256_add_ps(s0, s1));
    }
  }
  const int64_t full = n / 8 * 8;
  for (int64_t g = 0; g < G; ++g) {  // softmax over each head's row
    float* r = scores.data() + g * n;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < full; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(r + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    float m = *std::max_element(lanes, lanes + 8);
    for (int64_t t = full; t < n; ++t) m = std::max(m, r[t]);
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < full; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(r + t), mv));
      _mm256_storeu_ps(r + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = sum8(sum);
    for (int64_t t = full; t < n; ++t) {
      r[t] = std::exp(r[t] - m);
      total += r[t];
    }
    inv_sum[g] = 1.f / total;
  }
  for (int64_t t = 0; t < n; ++t) {  // pass 2: out = p . v
    const T* vr = v + ((table[t / BS] * BS + t % BS) * H_kv + h) * D;
    for (int64_t j = 0; j < nv; ++j) row[j] = load8(vr + 8 * j);
    for (int64_t g = 0; g < G; ++g) {
      const __m256 p = _mm256_set1_ps(scores[g * n + t]);
      float* ag = acc.data() + g * D;
      for (int64_t j = 0; j < nv; ++j)
        _mm256_storeu_ps(ag + 8 * j, _mm256_fmadd_ps(p, row[j], _mm256_loadu_ps(ag + 8 * j)));
    }
  }
  for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(acc[i] * inv_sum[i / D]);
}
#endif

template <typename T>
void decode_kernel(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* ctx_lens, T* out,
                   int64_t B, int64_t H, int64_t H_kv, int64_t D, int64_t BS, int64_t max_blocks, float scale) {
  const int64_t G = H / H_kv;
#ifdef ASERVE_AVX512
  const bool vec = D % 16 == 0 && D / 16 <= kMaxVec;
#endif
#ifdef ASERVE_AVX2
  const bool vec8 = D % 8 == 0 && D / 8 <= kMaxVec8;
#endif
  at::parallel_for(0, B * H_kv, 1, [&](int64_t begin, int64_t end) {
    Scratch buf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / H_kv, h = item % H_kv, n = ctx_lens[b];
      const T* qi = q + (b * H + h * G) * D;
      T* oi = out + (b * H + h * G) * D;
      const int64_t* table = tables + b * max_blocks;
#ifdef ASERVE_AVX512
      if constexpr (!std::is_same_v<T, double>) {  // double stays scalar
        if (vec) {
          decode_item_avx512(qi, k, v, table, n, oi, h, H_kv, G, D, BS, scale, buf);
          continue;
        }
      }
#endif
#ifdef ASERVE_AVX2
      if constexpr (!std::is_same_v<T, double>) {
        if (vec8) {
          decode_item_avx2(qi, k, v, table, n, oi, h, H_kv, G, D, BS, scale, buf);
          continue;
        }
      }
#endif
      decode_item_scalar(qi, k, v, table, n, oi, h, H_kv, G, D, BS, scale, buf);
    }
  });
}

}  // namespace

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
  if (paged_decode_bf16(q, k_cache, v_cache, t, c, scale, out)) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            t.data_ptr<int64_t>(), c.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, H_kv, D,
                            BS, t.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: they let the GIL go while they run, so the other threads of
  // the process (a second instance, the length predictor, the event loop) keep going meanwhile.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", no_gil);
  m.def("pack_bf16", &pack_bf16, "pack a bf16 weight [N, K] for the products below", py::arg("w"),
        py::arg("order") = kOrderPlain, no_gil);
  m.def("pack_f32", &pack_f32, "pack a bf16 weight [N, K] in fp32 for the products below (FMAs)", py::arg("w"),
        py::arg("order") = kOrderPlain, no_gil);
  m.def("linear_packed", &linear_packed, "x @ w.T (+ bias) with w packed (CPU, AVX512-BF16)", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::arg("fp32_out") = false,
        py::arg("widen") = false, no_gil);
  m.def("linear_packed_add_", &linear_packed_add_, "y += x @ w.T with w packed", py::arg("y"), py::arg("x"),
        py::arg("packed"), py::arg("widen") = false, no_gil);
  m.def("silu_mul_packed", &silu_mul_packed, "silu(x @ gate.T) * (x @ up.T) with gate_up packed in gate-up order",
        py::arg("x"), py::arg("packed"), py::arg("widen") = false, no_gil);
  m.def("llama_forward", &llama_forward, "a LLaMA step through every layer: chunks and decode tokens (CPU, bf16)",
        no_gil);
  m.def("paged_prefill", [](torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor seqs,
                            torch::Tensor tables, double scale) {
    auto out = torch::zeros_like(q);
    TORCH_CHECK(paged_prefill_bf16(q, k, v, seqs, tables, scale, out), "paged_prefill: bf16, head size 32/64/128");
    return out;
  }, "causal attention of prompt chunks over the pool (CPU, bf16)", no_gil);
  m.def("read_pass", &read_pass, "read a tensor once, as the products stream weights (memory probe)", no_gil);
  m.def("has_bf16_linear", &has_bf16_linear, "whether this build has the AVX512-BF16 products");
  m.def("pack_f32x32", &pack_f32x32, "pack an fp32 weight [N, K] for linear_f32", py::arg("w"), no_gil);
  m.def("linear_f32", &linear_f32, "x @ w.T (+ bias), fp32 x, w packed by pack_f32x32 (CPU, AVX2 FMA)", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), no_gil);
  m.def("rms_norm_f32", &rms_norm_f32, "RMSNorm of fp32 rows, scaled", no_gil);
  m.def("rope_f32", &rope_f32, "RoPE of fp32 [T, heads, D] (rotate half, signed sin table)", no_gil);
  m.def("has_f32_linear", &has_f32_linear, "whether this build has the AVX2 FMA products of fp32 x");
  m.attr("ORDER_PLAIN") = kOrderPlain;
  m.attr("ORDER_GATE_UP") = kOrderGateUp;
}
