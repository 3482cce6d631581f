// The bf16 fast path of paged decode attention (CPUs with AVX512-BF16; head size 32, 64 or 128;
// up to 8 query heads per KV head). paged_attention.cpp keeps the general paths.
//
// One work item is (request, chunk of its context). It makes a single pass over the chunk, 16
// tokens (one tile) at a time, through every KV head's rows of each token's record, with an
// online softmax (running max and sum per query head):
//
//   scores:  vdpbf16ps of each raw bf16 K row against the bf16 query (exact products, fp32
//            sums), 16 tokens' partial sums folded into one vector of 16 scores by a
//            transpose-add tree instead of 16 horizontal reductions;
//   softmax: the 16 scores exponentiated together; a head's running output is rescaled when
//            its running max grows;
//   values:  V rows widened to fp32 and accumulated with the probabilities in fp32 (the G x D
//            outputs of a KV head sit in registers for the tile, in L1 between tiles).
//
// A batch too small to give every thread several items (batch 1: one item for 2 threads) splits
// each request's context into chunks, and a second pass merges the chunks' partial results
// (max, sum, unnormalised output) the way flash-decoding does.
//
// Measured on the 2-core AMD EPYC, 30 layers of the default model's layout: with the K/V in
// cache, 17-18 ns a (token, KV head) on one core against 36 for the general AVX-512 path; with
// K/V from memory, as in a real step, every variant tried (two passes, one pass, per-head or
// per-request items, prefetch bursts or spread prefetches) ran at about 10 GB/s, memory-bound.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define ASERVE_BF16_ATTN 1
#endif

namespace {
using bf16 = c10::BFloat16;

#ifdef ASERVE_BF16_ATTN
struct Item {  // what one (request, chunk) item produces for each of the H query heads
  float* max;   // [H]
  float* sum;   // [H]
  float* acc;   // [H, D]: sum over the chunk of e^(score - max) * v
};

// one level of the transpose-sum tree: lanes of x and y interleaved and added pairwise
inline __m512 fold32(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
}
inline __m512 fold64(__m512 x, __m512 y) {
  const __m512d a = _mm512_castps_pd(x), b = _mm512_castps_pd(y);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}
inline __m512 fold128(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

// One (request, chunk) item for every KV head; G query heads per KV head, NV = D / 16.
// Accumulators live in L1 (acc): they are loaded into registers once per tile and KV head.
template <int G, int NV>
void chunk_item(const bf16* q, const bf16* k, const bf16* v, const int64_t* table, int64_t t0, int64_t t1,
                int64_t H_kv, int64_t BS, float scale, Item out) {
  constexpr int D = 16 * NV, NQ = NV / 2;
  const int64_t H = H_kv * G;
  for (int64_t i = 0; i < H; ++i) out.max[i] = -std::numeric_limits<float>::infinity(), out.sum[i] = 0.f;
  std::fill_n(out.acc, H * D, 0.f);
  alignas(64) float p[G][16];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = t0; t < t1; t += 16) {
    const int c = static_cast<int>(std::min<int64_t>(16, t1 - t));
    const __mmask16 live = static_cast<__mmask16>(c == 16 ? 0xFFFFu : (1u << c) - 1u);
    int64_t rec[16];  // each token's record (all KV heads) in the pool, in elements
    for (int i = 0; i < c; ++i) rec[i] = (table[(t + i) / BS] * BS + (t + i) % BS) * H_kv * D;
    for (int i = c; i < 16; ++i) rec[i] = rec[0];
    // the records of the next tile, asked for head by head while this tile's values are summed
    // (a burst of prefetches at the tile's start measured no better)
    int64_t ahead[16];
    const int64_t ta = t + 16;
    for (int i = 0; i < 16; ++i)
      ahead[i] = ta + i < t1 ? (table[(ta + i) / BS] * BS + (ta + i) % BS) * H_kv * D : -1;
    for (int64_t h = 0; h < H_kv; ++h) {
      const int64_t hd = h * D;
      for (int g = 0; g < G; ++g) {
        const int64_t head = h * G + g;
        __m512bh qv[NQ];
        for (int j = 0; j < NQ; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q + head * D + 32 * j);
        auto dot = [&](int i) {
          __m512 d = _mm512_setzero_ps();
          for (int j = 0; j < NQ; ++j) d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_loadu_si512(k + rec[i] + hd + 32 * j), qv[j]);
          return d;
        };
        __m512 b[4];
        for (int r = 0; r < 4; ++r)
          b[r] = fold64(fold32(dot(4 * r), dot(4 * r + 1)), fold32(dot(4 * r + 2), dot(4 * r + 3)));
        const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live,
                                            _mm512_mul_ps(fold128(fold128(b[0], b[1]), fold128(b[2], b[3])), vscale));
        const float old = out.max[head], m = std::max(old, _mm512_reduce_max_ps(s));
        float* acc = out.acc + head * D;
        if (m > old) {  // rescale what was summed under the old max (e^-inf = 0 on the first tile)
          const float alpha = std::exp(old - m);
          for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), _mm512_set1_ps(alpha)));
          out.sum[head] *= alpha;
          out.max[head] = m;
        }
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m))));
        out.sum[head] += _mm512_reduce_add_ps(e);
        _mm512_store_ps(p[g], e);
      }
      __m512 acc[G][NV];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_loadu_ps(out.acc + (h * G + g) * D + 16 * j);
      for (int i = 0; i < c; ++i) {
        if (ahead[i] >= 0) {
          const char* kn = reinterpret_cast<const char*>(k + ahead[i] + hd);
          const char* vn = reinterpret_cast<const char*>(v + ahead[i] + hd);
          for (int64_t off = 0; off < D * 2; off += 64) _mm_prefetch(kn + off, _MM_HINT_T0), _mm_prefetch(vn + off, _MM_HINT_T0);
        }
        const bf16* vr = v + rec[i] + hd;
        __m512 vf[NV];
        for (int j = 0; j < NV; ++j) vf[j] = widen16(vr + 16 * j);
        for (int g = 0; g < G; ++g) {
          const __m512 pg = _mm512_set1_ps(p[g][i]);
          for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(pg, vf[j], acc[g][j]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out.acc + (h * G + g) * D + 16 * j, acc[g][j]);
    }
  }
}

using ChunkFn = void (*)(const bf16*, const bf16*, const bf16*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                         float, Item);

template <int NV>
ChunkFn pick_g(int64_t G) {
  switch (G) {
    case 1: return chunk_item<1, NV>;
    case 2: return chunk_item<2, NV>;
    case 3: return chunk_item<3, NV>;
    case 4: return chunk_item<4, NV>;
    case 8: return chunk_item<8, NV>;
    default: return nullptr;
  }
}

ChunkFn pick(int64_t G, int64_t D) {
  switch (D) {
    case 32: return pick_g<2>(G);
    case 64: return pick_g<4>(G);
    case 128: return pick_g<8>(G);
    default: return nullptr;
  }
}
#endif
}  // namespace

bool paged_decode_bf16(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& tables, const torch::Tensor& ctx_lens, double scale, torch::Tensor& out) {
#ifdef ASERVE_BF16_ATTN
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), H_kv = k_cache.size(2);
  const int64_t G = H / H_kv, max_blocks = tables.size(1);
  const ChunkFn fn = q.scalar_type() == at::kBFloat16 ? pick(G, D) : nullptr;
  if (fn == nullptr || B == 0) return fn != nullptr;
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* kp = k_cache.data_ptr<bf16>();
  const bf16* vp = v_cache.data_ptr<bf16>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(lens, lens + B);
  // chunks per request: enough items for 2 per thread (4 or 1 measured slower at batch 1), no
  // chunk under 64 tokens
  const int64_t want = 2 * at::get_num_threads();
  const int64_t C = std::max<int64_t>(1, std::min((want + B - 1) / B, (longest + 63) / 64));
  const int64_t stride = H * (D + 2);  // one item's partial result: max[H], sum[H], acc[H, D]
  std::vector<float> part(static_cast<size_t>(B * C * stride));
  at::parallel_for(0, B * C, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / C, c = i % C, n = lens[b];
      const int64_t span = ((n + C - 1) / C + 15) / 16 * 16;  // whole 16-token tiles per chunk
      float* r = part.data() + i * stride;
      fn(qp + b * H * D, kp, vp, tp + b * max_blocks, std::min(n, c * span), std::min(n, (c + 1) * span), H_kv, BS,
         static_cast<float>(scale), Item{r, r + H, r + 2 * H});
    }
  });
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, head = i % H;
      float m = -std::numeric_limits<float>::infinity(), total = 0.f, o[128] = {0.f};
      for (int64_t c = 0; c < C; ++c) m = std::max(m, part[(b * C + c) * stride + head]);
      for (int64_t c = 0; c < C; ++c) {
        const float* r = part.data() + (b * C + c) * stride;
        if (r[head] == -std::numeric_limits<float>::infinity()) continue;  // an empty chunk
        const float w = std::exp(r[head] - m);
        total += w * r[H + head];
        for (int64_t d = 0; d < D; ++d) o[d] += w * r[2 * H + head * D + d];
      }
      bf16* dst = op + i * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = bf16(o[d] / total);
    }
  });
  return true;
#else
  return false;
#endif
}
