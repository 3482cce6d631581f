// Causal attention of prompt chunks over the paged KV pool, bf16, on CPUs with AVX512-BF16.
//
// A chunk of q_len tokens ending at context length ctx: its query t sits at position
// ctx - q_len + t and sees the keys at positions 0 .. that position (its own chunk's K/V is
// already in the pool, written by the caller; earlier chunks' too).
//
// One work item is (sequence, block of 16 queries, KV head): 16 x G query heads against the key
// tiles (16 keys) that the block's last query can see, with an online softmax per query head.
// Per key tile:
//
//   K rows of the tile, transposed to pairs   kp[D/2][16 keys] (uint32 = two bf16 of one key)
//   V rows widened to fp32                    vf[16 keys][D]
//   scores of 8 query heads at once           s_u = sum_j vdpbf16ps(kp[j], broadcast q_u pair j)
//                                             (8 independent chains: 16 keys' exact products a lane)
//   online softmax                            running max / sum per query head, output rescaled
//   values                                    acc_u[D] += p_u[key] * vf[key]   (fp32, four query
//                                             heads at a time: one V load, 16 FMA chains)
//
// Measured on the 2-core AMD EPYC against torch's SDPA (its CPU flash kernel) on the same chunks:
// see docs/BENCHMARKS.md ("Engine").
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
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
  std::vector<uint32_t> kp;  // [D/2][16]
  std::vector<float> vf, p, m, l, acc;
  void size(int64_t D, int64_t QH) {
    kp.resize(D / 2 * 16);
    vf.resize(16 * D);
    p.resize(QH * 16);
    m.resize(QH);
    l.resize(QH);
    acc.resize(QH * D);
  }
};

// K and V rows of keys k0 .. k0 + kc for KV head h, into the tile buffers (missing keys zero)
template <int D>
void load_tile(const Shape& s, const int64_t* table, int64_t h, int64_t k0, int kc, Scratch& sc) {
  const uint32_t* rows[16];
  for (int t = 0; t < 16; ++t) {
    const int64_t pos = k0 + std::min(t, kc - 1);
    const int64_t off = ((table[pos / s.BS] * s.BS + pos % s.BS) * s.H_kv + h) * D;
    rows[t] = reinterpret_cast<const uint32_t*>(s.k + off);
    for (int j = 0; j < D / 16; ++j)
      _mm512_storeu_ps(sc.vf.data() + t * D + 16 * j,
                       t < kc ? widen16(s.v + off + 16 * j) : _mm512_setzero_ps());
  }
  for (int j = 0; j < D / 2; ++j)  // transpose: kp[j][t] = key t's pair j
    for (int t = 0; t < 16; ++t) sc.kp[j * 16 + t] = t < kc ? rows[t][j] : 0u;
}

// 16 scores (one per key of the tile) for up to 8 query heads: qrows[u] points at query head u
template <int D>
void scores8(const Scratch& sc, const uint32_t* const* qrows, int nu, __m512* out) {
  __m512 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = _mm512_setzero_ps();
  for (int j = 0; j < D / 2; ++j) {
    const __m512bh kv = (__m512bh)_mm512_loadu_si512(sc.kp.data() + j * 16);
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u)
      acc[u] = _mm512_dpbf16_ps(acc[u], kv, (__m512bh)_mm512_set1_epi32(static_cast<int>(qrows[u][j])));
  }
  for (int u = 0; u < nu; ++u) out[u] = acc[u];
}

// acc[qh .. qh + NV) += p . V over the tile's kc keys
template <int D, int NV>
inline void values(Scratch& sc, int64_t qh, int kc) {
  __m512 a[NV][D / 16];
  for (int u = 0; u < NV; ++u)
    for (int j = 0; j < D / 16; ++j) a[u][j] = _mm512_loadu_ps(sc.acc.data() + (qh + u) * D + 16 * j);
  for (int t = 0; t < kc; ++t) {
    __m512 pt[NV];
    for (int u = 0; u < NV; ++u) pt[u] = _mm512_set1_ps(sc.p[(qh + u) * 16 + t]);
    for (int j = 0; j < D / 16; ++j) {
      const __m512 v = _mm512_loadu_ps(sc.vf.data() + t * D + 16 * j);
      for (int u = 0; u < NV; ++u) a[u][j] = _mm512_fmadd_ps(pt[u], v, a[u][j]);
    }
  }
  for (int u = 0; u < NV; ++u)
    for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(sc.acc.data() + (qh + u) * D + 16 * j, a[u][j]);
}

template <int D>
void prefill_item(const Shape& s, int64_t seq, int64_t qb, int64_t h, Scratch& sc) {
  const int64_t start = s.seqs[3 * seq], end = s.seqs[3 * seq + 1], ctx = s.seqs[3 * seq + 2];
  const int64_t first_pos = ctx - (end - start);  // position of the chunk's first query
  const int64_t r0 = start + 16 * qb, r1 = std::min(end, r0 + 16), nq = r1 - r0, G = s.G, QH = nq * G;
  const int64_t* table = s.tables + seq * s.max_blocks;
  const int64_t pos0 = first_pos + (r0 - start), last = pos0 + nq - 1;  // positions of the block's queries
  sc.size(D, QH);
  std::fill_n(sc.m.data(), QH, kNegInf);
  std::fill_n(sc.l.data(), QH, 0.f);
  std::fill_n(sc.acc.data(), QH * D, 0.f);
  const uint32_t* qrow[16 * 8];  // query head qh = i * G + g: row r0 + i, head h * G + g
  for (int64_t qh = 0; qh < QH; ++qh)
    qrow[qh] = reinterpret_cast<const uint32_t*>(s.q + ((r0 + qh / G) * s.H + h * G + qh % G) * D);
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t k0 = 0; k0 <= last; k0 += 16) {
    const int kc = static_cast<int>(std::min<int64_t>(16, last + 1 - k0));
    load_tile<D>(s, table, h, k0, kc, sc);
    for (int64_t u0 = 0; u0 < QH; u0 += 8) {
      const int nu = static_cast<int>(std::min<int64_t>(8, QH - u0));
      const uint32_t* rows[8];
      for (int u = 0; u < 8; ++u) rows[u] = qrow[u0 + std::min(u, nu - 1)];
      __m512 sv[8];
      scores8<D>(sc, rows, nu, sv);
      for (int u = 0; u < nu; ++u) {
        const int64_t qh = u0 + u, pos = pos0 + qh / G;
        // key k0 + t is visible to the query at pos when k0 + t <= pos (and t < kc)
        const __mmask16 live = _mm512_cmp_ps_mask(lane, _mm512_set1_ps(static_cast<float>(std::min<int64_t>(pos - k0, kc - 1))), _CMP_LE_OQ);
        const __m512 sc_ = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), live, _mm512_mul_ps(sv[u], _mm512_set1_ps(s.scale)));
        float* pq = sc.p.data() + qh * 16;
        if (!live) {
          _mm512_storeu_ps(pq, _mm512_setzero_ps());
          continue;
        }
        const float old = sc.m[qh], mx = std::max(old, _mm512_reduce_max_ps(sc_));
        if (mx > old) {
          const float alpha = std::exp(old - mx);  // 0 on the first tile
          float* a = sc.acc.data() + qh * D;
          for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(a + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * j), _mm512_set1_ps(alpha)));
          sc.l[qh] *= alpha;
          sc.m[qh] = mx;
        }
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc_, _mm512_set1_ps(mx))));
        sc.l[qh] += _mm512_reduce_add_ps(e);
        _mm512_storeu_ps(pq, e);
      }
    }
    // values: acc += p . V over the tile's keys, kNV query heads at a time so each V load feeds
    // kNV sums and 4 x kNV chains of FMAs run at once (one head alone ran 4 chains into the
    // FMA's latency); each head's sum still runs over the keys in order: the same bits
    constexpr int kNV = D >= 128 ? 2 : 4;
    int64_t qh = 0;
    for (; qh + kNV <= QH; qh += kNV) values<D, kNV>(sc, qh, kc);
    for (; qh < QH; ++qh) values<D, 1>(sc, qh, kc);
  }
  for (int64_t qh = 0; qh < QH; ++qh) {
    bf16* dst = s.out + ((r0 + qh / G) * s.H + h * G + qh % G) * D;
    const float inv = 1.f / sc.l[qh];
    for (int64_t d = 0; d < D; ++d) dst[d] = bf16(sc.acc[qh * D + d] * inv);
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
