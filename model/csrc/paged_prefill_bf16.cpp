// Causal attention of prompt chunks over the paged KV pool, bf16, on CPUs with AVX512-BF16.
//
// A chunk of q_len tokens ending at context length ctx: its query t sits at position
// ctx - q_len + t and sees the keys at positions 0 .. that position (its own chunk's K/V is
// already in the pool, written by the caller; earlier chunks' too).
//
// One work item is (sequence, block of 16 queries, KV head): its 16 x G query heads, in groups of
// 16 with a lane per query head, against the key tiles (16 keys) that the block's last query can
// see, with an online softmax per query head. Per key tile:
//
//   K rows of the tile, copied out of the pool  kt[16 keys][D/2]  (uint32 = two bf16 of one key)
//   V rows in pairs of keys                     vp[8][D]   (uint32 = V[2i][d], V[2i+1][d])
//   and per group of 16 query heads:
//   scores, 16 keys at once                     s_t = sum_j vdpbf16ps(qt[j], broadcast kt[t][j])
//                                               (qt: the group's pair j, a lane a head, transposed
//                                               once per item; 16 independent chains)
//   online softmax down the lanes               running max / sum per head with no reduction
//                                               across lanes; the sums so far scaled by exp(old -
//                                               new max), exactly 1 where the max did not move
//   values                                      acc_u[D] += vdpbf16ps(vp[i], broadcast (p_u[2i],
//                                               p_u[2i+1]) in bf16): the weights rounded to bf16
//                                               for the dot products, as torch's CPU flash
//                                               attention does, their fp32 sum the normaliser
//
// Each head's sums run over the keys in order whatever the heads beside it, so a query's output
// does not depend on how the prompt was cut into chunks or which queries share its block.
//
// The default model's attention for a 1,024-token prompt in two chunks of 512, one layer, on the
// 2-core AMD EPYC (Zen 5), ms at one / two threads: 9.2 / 5.6 with K transposed per tile, a lane
// per key (a reduction across lanes per head and tile) and fp32 values; 4.4 / 2.2 now.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define ASERVE_BF16_PREFILL 1
#include <omp.h>
#endif

namespace {
using bf16 = c10::BFloat16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#ifdef ASERVE_BF16_PREFILL
struct Shape {
  const bf16* q;        // [T, H, D]
  const bf16* k;        // pool slices [num_blocks, BS, H_kv, D]
  const bf16* v;
  const int64_t* seqs;  // [P, 3]: start row, end row, context length
  const int64_t* tables;
  int64_t max_blocks, H, H_kv, G, BS;
  float scale;
  bf16* out;            // [T, H, D]
};

struct Scratch {  // one thread's buffers, reused across its items
  std::vector<uint32_t> qt;  // [groups][D/2][16]: the item's query heads, 16 a group, pair j of each
  std::vector<uint32_t> kt;  // [16][D/2]: the tile's K rows, copied out of the pool
  std::vector<uint32_t> vp;  // [8][D]: the tile's V rows in pairs of keys (2i, 2i+1) for each d
  std::vector<uint32_t> pp;  // [8][16]: the weights of the tile's key pairs, bf16 pairs, a lane a head
  std::vector<float> alpha, m, l, pos, acc;
  void size(int64_t D, int64_t groups) {
    qt.resize(groups * D / 2 * 16);
    kt.resize(16 * D / 2);
    vp.resize(8 * D);
    pp.resize(8 * 16);
    alpha.resize(16);
    m.resize(groups * 16);
    l.resize(groups * 16);
    pos.resize(groups * 16);
    acc.resize(groups * 16 * D);
  }
};

// 16 lanes of bf16 pairs (first, second): lane i holds first[i] in its low half, second[i] in its high
inline __m512i pairs16(__m256i first, __m256i second) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(first), _mm512_slli_epi32(_mm512_cvtepu16_epi32(second), 16));
}

// Keys k0 .. k0 + kc of KV head h: K rows into kt (past kc: the last key's, masked out by the
// caller), V rows paired into vp (past kc: zero)
template <int D>
void load_tile(const Shape& s, const int64_t* table, int64_t h, int64_t k0, int kc, Scratch& sc) {
  const bf16* vrow[16];
  for (int t = 0; t < 16; ++t) {
    const int64_t pos = k0 + std::min(t, kc - 1);
    const int64_t off = ((table[pos / s.BS] * s.BS + pos % s.BS) * s.H_kv + h) * D;
    std::copy_n(reinterpret_cast<const uint32_t*>(s.k + off), D / 2, sc.kt.data() + t * (D / 2));
    vrow[t] = s.v + off;
  }
  auto row16 = [&](int t, int j) {  // V values 16 j .. 16 j + 16 of key t (zero past kc)
    return t < kc ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[t] + 16 * j)) : _mm256_setzero_si256();
  };
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < D / 16; ++j) _mm512_storeu_si512(sc.vp.data() + i * D + 16 * j, pairs16(row16(2 * i, j), row16(2 * i + 1, j)));
}

// acc[u] (query heads lane0 .. lane0 + NV of the group) = acc[u] * alpha[u] + the tile's weights
// . V, a pair of keys a vdpbf16ps, pairs in order
template <int D, int NV>
inline void values(Scratch& sc, float* acc, int lane0, int pairs) {
  __m512 a[NV][D / 16];
  for (int u = 0; u < NV; ++u) {
    const __m512 al = _mm512_set1_ps(sc.alpha[lane0 + u]);
    for (int j = 0; j < D / 16; ++j) a[u][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + (lane0 + u) * D + 16 * j), al);
  }
  for (int i = 0; i < pairs; ++i) {
    __m512bh pt[NV];
    for (int u = 0; u < NV; ++u) pt[u] = (__m512bh)_mm512_set1_epi32(static_cast<int>(sc.pp[i * 16 + lane0 + u]));
    for (int j = 0; j < D / 16; ++j) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(sc.vp.data() + i * D + 16 * j);
      for (int u = 0; u < NV; ++u) a[u][j] = _mm512_dpbf16_ps(a[u][j], v, pt[u]);
    }
  }
  for (int u = 0; u < NV; ++u)
    for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(acc + (lane0 + u) * D + 16 * j, a[u][j]);
}

template <int D>
void prefill_item(const Shape& s, int64_t seq, int64_t qb, int64_t h, Scratch& sc) {
  const int64_t start = s.seqs[3 * seq], end = s.seqs[3 * seq + 1], ctx = s.seqs[3 * seq + 2];
  const int64_t first_pos = ctx - (end - start);  // position of the chunk's first query
  const int64_t r0 = start + 16 * qb, r1 = std::min(end, r0 + 16), nq = r1 - r0, G = s.G, QH = nq * G;
  const int64_t* table = s.tables + seq * s.max_blocks;
  const int64_t pos0 = first_pos + (r0 - start), last = pos0 + nq - 1;  // positions of the block's queries
  const int64_t groups = (QH + 15) / 16;
  sc.size(D, groups);
  // query head qh = i * G + g: row r0 + i, head h * G + g; lanes past QH repeat the last head
  for (int64_t qh = 0; qh < groups * 16; ++qh) {
    const int64_t u = std::min(qh, QH - 1);
    const uint32_t* row = reinterpret_cast<const uint32_t*>(s.q + ((r0 + u / G) * s.H + h * G + u % G) * D);
    uint32_t* col = sc.qt.data() + (qh / 16) * (D / 2) * 16 + qh % 16;
    for (int j = 0; j < D / 2; ++j) col[j * 16] = row[j];
    sc.pos[qh] = static_cast<float>(pos0 + u / G);
  }
  std::fill_n(sc.m.data(), groups * 16, kNegInf);
  std::fill_n(sc.l.data(), groups * 16, 0.f);
  std::fill_n(sc.acc.data(), groups * 16 * D, 0.f);
  const __m512 scale = _mm512_set1_ps(s.scale), ninf = _mm512_set1_ps(kNegInf), one = _mm512_set1_ps(1.f);
  const uint32_t* kt = sc.kt.data();
  for (int64_t k0 = 0; k0 <= last; k0 += 16) {
    const int kc = static_cast<int>(std::min<int64_t>(16, last + 1 - k0));
    load_tile<D>(s, table, h, k0, kc, sc);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t lanes = std::min<int64_t>(16, QH - 16 * g);
      const int64_t lo = pos0 + (16 * g) / G, hi = pos0 + (16 * g + lanes - 1) / G;  // the group's positions
      if (hi < k0) continue;  // no query of the group sees a key of this tile: nothing changes
      const uint32_t* qt = sc.qt.data() + g * (D / 2) * 16;
      __m512 sv[16];
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) sv[t] = _mm512_setzero_ps();
      for (int j = 0; j < D / 2; ++j) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt + j * 16);
#pragma GCC unroll 16
        for (int t = 0; t < 16; ++t)
          sv[t] = _mm512_dpbf16_ps(sv[t], qv, (__m512bh)_mm512_set1_epi32(static_cast<int>(kt[t * (D / 2) + j])));
      }
      // key k0 + t is visible to the query at pos when k0 + t <= pos (and t < kc)
      const bool diagonal = k0 + kc - 1 > lo;
      const __m512 posv = _mm512_loadu_ps(sc.pos.data() + 16 * g);
      __mmask16 live[16];
      __m512 mx = _mm512_loadu_ps(sc.m.data() + 16 * g);
      const __m512 old = mx;
      for (int t = 0; t < 16; ++t) {
        live[t] = t >= kc ? 0
                  : diagonal ? _mm512_cmp_ps_mask(posv, _mm512_set1_ps(static_cast<float>(k0 + t)), _CMP_GE_OQ)
                             : static_cast<__mmask16>(0xFFFF);
        sv[t] = _mm512_mask_mov_ps(ninf, live[t], _mm512_mul_ps(sv[t], scale));
        mx = _mm512_max_ps(mx, sv[t]);
      }
      // the sums so far scaled to the new max (exactly 1 where it did not move)
      const __mmask16 moved = _mm512_cmp_ps_mask(mx, old, _CMP_GT_OQ);
      const __m512 alpha = _mm512_mask_mov_ps(one, moved, exp16(_mm512_sub_ps(old, mx)));
      __m512 l = _mm512_mul_ps(_mm512_loadu_ps(sc.l.data() + 16 * g), alpha);
      const int pairs = (kc + 1) / 2;
      auto weight = [&](int t) {  // key t's weights (e^(score - max)) added to the sums, in bf16 (zero past kc)
        if (t >= kc) return _mm256_setzero_si256();
        const __m512 e = _mm512_maskz_mov_ps(live[t], exp16(_mm512_sub_ps(sv[t], mx)));
        l = _mm512_add_ps(l, e);
        return (__m256i)_mm512_cvtneps_pbh(e);
      };
      for (int i = 0; i < pairs; ++i) {
        const __m256i first = weight(2 * i);  // in key order: the sums add key 2i before 2i + 1
        _mm512_storeu_si512(sc.pp.data() + i * 16, pairs16(first, weight(2 * i + 1)));
      }
      _mm512_storeu_ps(sc.m.data() + 16 * g, mx);
      _mm512_storeu_ps(sc.l.data() + 16 * g, l);
      _mm512_storeu_ps(sc.alpha.data(), alpha);
      // values: kNV query heads at a time so each V load feeds kNV sums and 4 x kNV chains of
      // dot products run at once; each head's sum still runs over the key pairs in order
      constexpr int kNV = D >= 128 ? 2 : 4;
      float* acc = sc.acc.data() + 16 * g * D;
      int u = 0;
      for (; u + kNV <= lanes; u += kNV) values<D, kNV>(sc, acc, u, pairs);
      for (; u < lanes; ++u) values<D, 1>(sc, acc, u, pairs);
    }
  }
  for (int64_t qh = 0; qh < QH; ++qh) {
    bf16* dst = s.out + ((r0 + qh / G) * s.H + h * G + qh % G) * D;
    const float inv = 1.f / sc.l[qh];
    const float* a = sc.acc.data() + qh * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = bf16(a[d] * inv);
  }
}

template <int D>
void run(const Shape& s, int64_t P) {
  struct Work { int64_t seq, qb, h, cost; };
  std::vector<Work> items;
  for (int64_t seq = 0; seq < P; ++seq) {
    const int64_t n = s.seqs[3 * seq + 1] - s.seqs[3 * seq], ctx = s.seqs[3 * seq + 2];
    for (int64_t qb = 0; qb * 16 < n; ++qb)
      for (int64_t h = 0; h < s.H_kv; ++h) items.push_back({seq, qb, h, ctx - n + 16 * qb});
  }
  // the longest items first, handed out one at a time: causal blocks differ in length
  std::sort(items.begin(), items.end(), [](const Work& a, const Work& b) { return a.cost > b.cost; });
  const int64_t num = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num)))
  {
    Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num; ++i) prefill_item<D>(s, items[i].seq, items[i].qb, items[i].h, sc);
  }
}
#endif
}  // namespace

bool paged_prefill_bf16(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& seqs, const torch::Tensor& tables, double scale, torch::Tensor& out) {
#ifdef ASERVE_BF16_PREFILL
  const int64_t H = q.size(1), D = q.size(2), H_kv = k_cache.size(2);
  if (q.scalar_type() != at::kBFloat16 || k_cache.scalar_type() != at::kBFloat16 || !(D == 32 || D == 64 || D == 128) ||
      H % H_kv != 0 || H / H_kv > 8)
    return false;
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "paged_prefill: contiguous tensors");
  TORCH_CHECK(seqs.dim() == 2 && seqs.size(1) == 3 && seqs.scalar_type() == at::kLong && seqs.is_contiguous(),
              "paged_prefill: seqs [P, 3] int64");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == seqs.size(0) && tables.scalar_type() == at::kLong &&
                  tables.is_contiguous(), "paged_prefill: tables [P, max_blocks] int64");
  const Shape s{q.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), seqs.data_ptr<int64_t>(),
                tables.data_ptr<int64_t>(), tables.size(1), H, H_kv, H / H_kv, k_cache.size(1),
                static_cast<float>(scale), out.data_ptr<bf16>()};
  const int64_t P = seqs.size(0);
  for (int64_t i = 0; i < P; ++i) {
    const int64_t start = s.seqs[3 * i], end = s.seqs[3 * i + 1], ctx = s.seqs[3 * i + 2];
    TORCH_CHECK(0 <= start && start < end && end <= q.size(0) && end - start <= ctx &&
                    (ctx + s.BS - 1) / s.BS <= s.max_blocks, "paged_prefill: bad sequence ", i);
  }
  if (D == 32) run<32>(s, P);
  else if (D == 64) run<64>(s, P);
  else run<128>(s, P);
  return true;
#else
  return false;
#endif
}
