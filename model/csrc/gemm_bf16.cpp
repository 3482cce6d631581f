// bf16 matrix products on CPUs with AVX512-BF16, over weights packed once at load time.
//
// vdpbf16ps multiplies 32 bf16 pairs and adds each pair's two products into one of 16 fp32
// lanes. With the weight stored as [N, K] (torch's layout), a lane holds part of ONE output's
// sum and every output ends in a 16-lane horizontal reduction. Packed so that a lane is an
// OUTPUT instead, the reduction disappears: 64 output rows form a group, and at each pair of
// input columns (k, k+1) the group's 64 rows store their two values side by side:
//
//   packed [G, K/2, 64, 2]     G = ceil(N / 64) groups, rows past N are zero
//
//            k-pair 0                      k-pair 1
//   group 0 | r0k0 r0k1 r1k0 r1k1 .. r63k1 | r0k2 r0k3 .. r63k3 | ...   (256 bytes a k-pair)
//   group 1 | ...
//
// One zmm load is 16 rows x one k-pair; a 32-bit broadcast of x's (k, k+1) pair against it
// adds 16 outputs' worth of products. A group is read front to back once per block of up to six
// x rows: at one block the weights stream sequentially from memory (asked into L2 a little ahead,
// see kPrefetchBytes); with more rows the group goes in k-chunks of 16 KB, every block over a
// chunk while the next one is asked into L2 (run_group), so the stream runs under all the blocks'
// FMAs and each block re-reads the chunk from cache.
//
// Measured on the 2-core AMD EPYC (Zen 4) against the old row-major kernel and torch's matmul,
// the default model's 120 layer weights: 1 row 5.6 ms (38 GB/s; row-major 12.9, torch 29),
// 32 rows 21 ms (torch 42-49), 512 rows 274 ms = 396 GFLOP/s (torch 372 ms): faster at
// every size, so every bf16 CPU linear goes through here.
//
// Epilogues (what happens to a block's fp32 sums): store as bf16 or fp32 (+ fp32 bias), add into a bf16
// residual stream (rounded to bf16 first, as a separate linear then add would), or SwiGLU's
// silu(gate) * up for a gate_up weight packed with ``kOrderGateUp`` (each group's first 32 rows
// are gate rows, its last 32 the matching up rows).
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define ASERVE_BF16_DP 1
#endif

namespace {
using bf16 = c10::BFloat16;
constexpr int64_t kTile = 16;              // output rows in one zmm of sums
constexpr int64_t kTiles = 4;              // zmm of sums per x row in a block
constexpr int64_t kGroup = kTile * kTiles; // output rows a group
constexpr int kMaxRows = 6;                // x rows a block: 6 x 4 sums + 4 weights fit in 32 registers
// How far ahead the weights are asked into L2: at one x row the product is a read of the weights,
// and two cores' reads are bounded by how many misses each keeps in flight. 4 KiB ahead into L2
// took the default model's 120 layer weights from 9.2 to 8.3 ms at 1 row (8 KiB and L3 the same;
// into L1, at 1-4 KiB, slower); at 32 rows, where the product is compute-bound, it changes nothing.
constexpr int64_t kPrefetchBytes = 4096;
// From how many x rows a widened product widens each k-chunk once into an fp32 copy (widen_group)
// instead of in registers at every block of rows. The default model's 121 products at one thread
// (Xeon, 2026-11-30), chunks of 64 k-pairs, in registers / once, ms: 24 rows 51 / 57, 32 rows 69 /
// 69, 48 rows 99 / 94, 64 rows 134 / 123, 96 rows 199 / 181.
constexpr int64_t kWidenOnceRows = 32;

// packed row r of group g holds source row src_row(g, r), or -1 (zero padding)
int64_t src_row(int64_t order, int64_t N, int64_t g, int64_t r) {
  if (order == kOrderGateUp) {  // N = 2 I: gate rows [0, I), up rows [I, 2I)
    const int64_t half = N / 2, j = g * (kGroup / 2) + r % (kGroup / 2);
    return j < half ? (r < kGroup / 2 ? j : half + j) : -1;
  }
  const int64_t n = g * kGroup + r;
  return n < N ? n : -1;
}

#ifdef ASERVE_BF16_DP
// The fp32 sums of one block: x rows m0 .. m0 + MB, outputs of group g (64, or 32 for SwiGLU).
template <int MB>
using Sums = __m512[MB][kTiles];
// The three ways a block's sums are made: bf16 dot products over bf16-packed weights, FMAs over
// fp32-packed ones (pack_f32, x in fp32), or FMAs over bf16-packed weights widened to fp32 in
// registers (x in fp32: the fp32 kind's sums, bit for bit, from half its weight bytes).
constexpr int kDot = 0, kF32 = 1, kWiden = 2;

inline void store_bf16(bf16* dst, __m512 v, int64_t valid) {  // valid of the 16 values
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
  if (valid >= kTile) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), b);
  else if (valid > 0) _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << valid) - 1u), b);
}

inline __m512 widen(const bf16* src, int64_t valid) {  // widen16 of the first valid of 16 (the rest 0)
  if (valid >= kTile) return widen16(src);
  const __m256i raw = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << valid) - 1u), src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// A packed zmm of 16 (k, k + 1) bf16 pairs widened to fp32, each exact: k's values (the low
// halves, shifted up) and k + 1's (the high halves, the low ones masked off).
inline __m512 even_k(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_k(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline __m512 round_bf16(__m512 v) {  // what storing as bf16 and reading back gives
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}


// The fp32 sums of one block over KS k steps. kDot (pack_bf16): a step is a k-pair, four bf16 dot
// products a row. kF32 (pack_f32, or a chunk widened once): a step is one k of fp32 x, four FMAs
// a row. kWiden (pack_bf16): a step is a k-pair widened to fp32 in registers, eight FMAs a row in
// kF32's order. Where bf16 dot products issue at half the rate of fp32 FMAs (a Xeon with
// AVX512-BF16 and no AMX: 86 against 175 GFLOP/s a core, measured with independent chains), the
// FMAs give nearly twice the sums a cycle once the rows are enough to make the product
// compute-bound. A step's weights are 256 bytes in every kind.
// Always inlined: out of line, its sums went through memory and the products ran 3-4x slower.
//
// Prefetch: a step asks for the bytes [pf + k * pf_step, + pf_step) into L2 (pf_step of 256: four
// lines, the step's own weights kPrefetchBytes ahead). init: the sums to go on from ([MB, 64] rows
// kGroup apart, a k-chunk's earlier sums), or null to start at zero.
template <int KIND, int MB>
__attribute__((always_inline)) inline void block_sums(const void* xv, int64_t ldx, const void* wv, int64_t KS,
                                                      Sums<MB>& acc, const char* pf, int64_t pf_step,
                                                      const float* init) {
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int t = 0; t < kTiles; ++t)
      acc[m][t] = init ? _mm512_loadu_ps(init + m * kGroup + t * kTile) : _mm512_setzero_ps();
  for (int64_t k = 0; k < KS; ++k) {
    const char* wk = static_cast<const char*>(wv) + k * 256;
    if (pf_step == 256) {  // a block's own stream, four lines a step: unrolled (looped, a 2-row step took 2-3% longer)
      const char* ahead = pf + k * 256;
      _mm_prefetch(ahead, _MM_HINT_T1), _mm_prefetch(ahead + 64, _MM_HINT_T1);
      _mm_prefetch(ahead + 128, _MM_HINT_T1), _mm_prefetch(ahead + 192, _MM_HINT_T1);
    } else {
      for (int64_t o = 0; o < pf_step; o += 64) _mm_prefetch(pf + k * pf_step + o, _MM_HINT_T1);
    }
    const __m512i w0 = _mm512_load_si512(wk), w1 = _mm512_load_si512(wk + 64), w2 = _mm512_load_si512(wk + 128),
                  w3 = _mm512_load_si512(wk + 192);
    if constexpr (KIND == kWiden) {
      // the bf16 pairs widened in registers; per row, k's FMA then k + 1's, the fp32 kind's order
      const float* x = static_cast<const float*>(xv) + 2 * k;
      const __m512i ws[kTiles] = {w0, w1, w2, w3};
#pragma GCC unroll 4
      for (int t = 0; t < kTiles; ++t) {
        const __m512 we = even_k(ws[t]), wo = odd_k(ws[t]);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          acc[m][t] = _mm512_fmadd_ps(we, _mm512_set1_ps(x[m * ldx]), acc[m][t]);
          acc[m][t] = _mm512_fmadd_ps(wo, _mm512_set1_ps(x[m * ldx + 1]), acc[m][t]);
        }
      }
      continue;
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      if constexpr (KIND == kF32) {
        const __m512 xb = _mm512_set1_ps(static_cast<const float*>(xv)[m * ldx + k]);
        acc[m][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(w0), xb, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(w1), xb, acc[m][1]);
        acc[m][2] = _mm512_fmadd_ps(_mm512_castsi512_ps(w2), xb, acc[m][2]);
        acc[m][3] = _mm512_fmadd_ps(_mm512_castsi512_ps(w3), xb, acc[m][3]);
      } else {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(static_cast<const uint32_t*>(xv)[m * ldx + k]));
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, xb);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)w1, xb);
        acc[m][2] = _mm512_dpbf16_ps(acc[m][2], (__m512bh)w2, xb);
        acc[m][3] = _mm512_dpbf16_ps(acc[m][3], (__m512bh)w3, xb);
      }
    }
  }
}

struct Job {
  const bf16* x;        // [M, K]
  const bf16* w;        // packed
  int64_t M, K, N;      // N: outputs of the product (I for SwiGLU)
  int epilogue;         // kStore, kStoreF32, kAddInto, kSiluMul
  const float* bias;    // kStore and kStoreF32, may be null
  void* y;              // [M, N] bf16 (fp32 for kStoreF32)
  const float* xf = nullptr;  // x in fp32 [M, K] where w is packed fp32 (pack_f32), or widened
  bool widen = false;         // bf16-packed w, FMAs over it widened (kWiden)
  int kind() const { return widen ? kWiden : xf ? kF32 : kDot; }
  int64_t steps() const { return kind() == kF32 ? K : K / 2; }  // k steps of a group: single ks (fp32) or k-pairs
};
constexpr int kStore = 0, kAddInto = 1, kSiluMul = 2, kStoreF32 = 3;

template <int MB>
__attribute__((always_inline)) inline void finish(const Job& j, int64_t m0, int64_t g, Sums<MB>& acc) {
  if (j.epilogue == kSiluMul) {  // tiles 0, 1: gate of outputs n0 .. n0 + 32; tiles 2, 3: their up
    const int64_t n0 = g * (kGroup / 2);
    for (int m = 0; m < MB; ++m)
      for (int t = 0; t < 2; ++t) {
        const __m512 gate = round_bf16(acc[m][t]), up = round_bf16(acc[m][t + 2]);
        // silu rounded to bf16, then the product rounded: torch's F.silu(gate) * up in bf16
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
        const __m512 s = round_bf16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        store_bf16(static_cast<bf16*>(j.y) + (m0 + m) * j.N + n0 + t * kTile, _mm512_mul_ps(s, up), j.N - n0 - t * kTile);
      }
    return;
  }
  const int64_t n0 = g * kGroup;
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < kTiles; ++t) {
      const int64_t n = n0 + t * kTile, valid = j.N - n;
      if (valid <= 0) break;
      const __mmask16 mask = valid >= kTile ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1u);
      __m512 v = acc[m][t];
      if (j.epilogue != kAddInto && j.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, j.bias + n));
      if (j.epilogue == kStoreF32) {
        _mm512_mask_storeu_ps(static_cast<float*>(j.y) + (m0 + m) * j.N + n, mask, v);
        continue;
      }
      bf16* dst = static_cast<bf16*>(j.y) + (m0 + m) * j.N + n;
      if (j.epilogue == kAddInto) v = _mm512_add_ps(widen(dst, valid), round_bf16(v));
      store_bf16(dst, v, valid);
    }
}

// Where a block's sums start and what its steps prefetch (block_sums' init, pf and pf_step).
struct Flow {
  const float* init = nullptr;  // rows kGroup apart from the block's first: an earlier k-chunk's sums
  const char* pf = nullptr;     // null: the block's own weights, kPrefetchBytes ahead
  int64_t pf_step = 256;
};

// Rows m0 .. m0 + MB of group g over the k steps [k0, k1) (the steps of wide, a widened chunk,
// where given): finished (the epilogue) when part is null, else the sums stored in part [M, 64]
// (for the caller to add up, or to go on from at the next k-chunk).
template <int MB>
void run_block(const Job& j, int64_t m0, int64_t g, int64_t k0, int64_t k1, float* part, const float* wide,
               const Flow& flow) {
  const int64_t KS = j.steps();
  Sums<MB> acc;
  const char* w = reinterpret_cast<const char*>(j.w) + (g * KS + k0) * 256;  // 256 bytes a k step
  const char* pf = flow.pf ? flow.pf : w + kPrefetchBytes;
  const float* init = flow.init ? flow.init + m0 * kGroup : nullptr;
  if (wide)  // the chunk's k-pairs widened once (widen_group): the fp32 kind's FMAs over them
    block_sums<kF32, MB>(j.xf + m0 * j.K + 2 * k0, j.K, wide, 2 * (k1 - k0), acc, pf, flow.pf_step, init);
  else if (j.widen)
    block_sums<kWiden, MB>(j.xf + m0 * j.K + 2 * k0, j.K, w, k1 - k0, acc, pf, flow.pf_step, init);
  else if (j.xf)
    block_sums<kF32, MB>(j.xf + m0 * KS + k0, KS, w, k1 - k0, acc, pf, flow.pf_step, init);
  else
    block_sums<kDot, MB>(reinterpret_cast<const uint32_t*>(j.x) + m0 * KS + k0, KS, w, k1 - k0, acc, pf,
                         flow.pf_step, init);
  if (part == nullptr) return finish<MB>(j, m0, g, acc);
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < kTiles; ++t) _mm512_storeu_ps(part + (m0 + m) * kGroup + t * kTile, acc[m][t]);
}

// Group g's k-pairs [k0, k1) widened to fp32 in the fp32 kind's layout ([2 (k1 - k0), 64]), into buf.
void widen_group(const Job& j, int64_t g, int64_t k0, int64_t k1, float* buf) {
  const char* w = reinterpret_cast<const char*>(j.w) + (g * j.steps() + k0) * 256;
  for (int64_t k = 0; k < k1 - k0; ++k)
    for (int t = 0; t < kTiles; ++t) {
      const __m512i v = _mm512_load_si512(w + k * 256 + t * 64);
      _mm512_store_ps(buf + 2 * k * kGroup + t * kTile, even_k(v));
      _mm512_store_ps(buf + (2 * k + 1) * kGroup + t * kTile, odd_k(v));
    }
}

// The epilogue of a group whose sums were made in parts (summed into part [M, 64]).
void finish_parts(const Job& j, int64_t g, const float* part) {
  for (int64_t m = 0; m < j.M; ++m) {
    Sums<1> acc;
    for (int t = 0; t < kTiles; ++t) acc[0][t] = _mm512_loadu_ps(part + m * kGroup + t * kTile);
    finish<1>(j, m, g, acc);
  }
}

// Rows 0 .. M of group g over the k steps [k0, k1), a block of up to kMaxRows rows at a time. A
// flow with its own prefetch bytes spreads them over the blocks: each block asks for the next
// (k1 - k0) * pf_step of them.
void run_rows(const Job& j, int64_t g, int64_t k0, int64_t k1, float* part, const float* wide, Flow flow) {
  const bool spread = flow.pf != nullptr;
  int64_t m = 0;
  for (; m + kMaxRows <= j.M; m += kMaxRows) {
    run_block<kMaxRows>(j, m, g, k0, k1, part, wide, flow);
    if (spread) flow.pf += (k1 - k0) * flow.pf_step;
  }
  switch (j.M - m) {
    case 1: run_block<1>(j, m, g, k0, k1, part, wide, flow); break;
    case 2: run_block<2>(j, m, g, k0, k1, part, wide, flow); break;
    case 3: run_block<3>(j, m, g, k0, k1, part, wide, flow); break;
    case 4: run_block<4>(j, m, g, k0, k1, part, wide, flow); break;
    case 5: run_block<5>(j, m, g, k0, k1, part, wide, flow); break;
    default: break;
  }
}

// More rows than a block holds read a group's weights once a block. Run whole, the first block
// streamed them from memory at one core's bandwidth while the others found them in L2: the stream
// and the FMAs took turns. In k-chunks of kChunkSteps (16 KB of weights), every block runs over a
// chunk before the next chunk starts, the sums kept in part (or a buffer) between chunks, and the
// next chunk's weights are asked into L2 over all the blocks' steps, so the memory stream runs
// under the whole product's FMAs. Widened products of kWidenOnceRows rows or more widen each chunk
// once into an L1 copy and run the fp32 kind over it (the register widening, 8 uops a k-pair
// beside up to 48 FMAs, paid once a chunk instead of once a block). Each output's sum still runs
// over k in order, so the sums are the same bit for bit.
//
// The default model's 121 widened products at one thread (Xeon, 2026-11-30, medians of three
// interleaved rounds), whole groups (the chunk-free kernel, widened into L2 from 96 rows) / in
// chunks, ms: 8 rows 29 / 28, 16 rows 45 / 41, 24 rows 59 / 52, 32 rows 76 / 71, 64 rows 138 / 123,
// 128 rows 250 / 238, 256 rows 460 / 464 (docs/notes/peer.md, "Products in k-chunks").
constexpr int64_t kChunkSteps = 64;

void run_group(const Job& j, int64_t g, int64_t k0, int64_t k1, float* part) {
  if (j.M <= kMaxRows) return run_rows(j, g, k0, k1, part, nullptr, Flow{});
  thread_local std::vector<float> own, copy;
  float* sums = part;
  if (sums == nullptr) {
    own.resize(static_cast<size_t>(j.M * kGroup));
    sums = own.data();
  }
  float* wide = nullptr;  // the chunk widened once, 64-byte aligned
  if (j.widen && j.M >= kWidenOnceRows) {
    copy.resize(static_cast<size_t>(2 * kChunkSteps * kGroup + kTile));
    wide = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(copy.data()) + 63) & ~uintptr_t{63});
  }
  const int64_t blocks = (j.M + kMaxRows - 1) / kMaxRows;
  const char* w = reinterpret_cast<const char*>(j.w) + g * j.steps() * 256;
  for (int64_t kc = k0; kc < k1; kc += kChunkSteps) {
    const int64_t kn = std::min(k1, kc + kChunkSteps);
    Flow flow;
    flow.init = kc > k0 ? sums : nullptr;
    flow.pf = w + kn * 256;  // the next chunk (after the group's last: the next group's first)
    flow.pf_step = (kChunkSteps * 256 / (blocks * (kn - kc)) + 63) / 64 * 64;
    if (wide) {
      widen_group(j, g, kc, kn, wide);
      flow.pf_step /= 2;  // the copy's steps are single ks, two a k-pair
    }
    run_rows(j, g, kc, kn, sums, wide, flow);
  }
  if (part == nullptr) finish_parts(j, g, sums);
}

// How the threads share a product. At fewer than kClaimRows rows (decode steps) each thread takes
// a fixed share: the groups split evenly over the threads when they divide evenly; otherwise the
// (group, k-pair) space is (the default model's o and down weights have 9 groups, so two threads
// took 5 and 4 and one waited a ninth of the time), and a group cut at a thread's boundary is
// summed in two parts, added up and finished after the parallel pass.
//
// From kClaimRows rows (prompt chunks) a fixed share made the product wait for the thread whose
// core something else runs on (on two cores, a benchmark's client beside the server). There the
// product is cut into units, a group over a range of rows (each output's sum still runs over all
// of k, as at one thread), at least kUnitsPerThread a thread and a multiple of the thread count
// where the rows allow, which the threads claim in turn from a counter: a thread slowed by another
// process claims fewer, and with none slowed each claims as many.
constexpr int64_t kClaimRows = 4 * kMaxRows;
constexpr int64_t kUnitsPerThread = 8;

// Rows [m0, m1) of j as a job of their own.
Job rows_of(const Job& j, int64_t m0, int64_t m1) {
  Job r = j;
  r.x = j.x + m0 * j.K;
  if (j.xf) r.xf = j.xf + m0 * j.K;
  if (j.epilogue == kStoreF32)
    r.y = static_cast<float*>(j.y) + m0 * j.N;
  else
    r.y = static_cast<bf16*>(j.y) + m0 * j.N;
  r.M = m1 - m0;
  return r;
}

void run_claimed(const Job& j, int64_t groups, int64_t T) {
  const int64_t blocks = (j.M + kMaxRows - 1) / kMaxRows;
  int64_t R = 1;  // row ranges a group
  while (R < blocks && (groups * R < kUnitsPerThread * T || (groups * R) % T != 0)) ++R;
  const int64_t units = groups * R;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, T, 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < units;
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t g = u / R, r = u % R;  // R <= blocks: every range holds a block or more
      const int64_t m0 = r * blocks / R * kMaxRows, m1 = std::min(j.M, (r + 1) * blocks / R * kMaxRows);
      run_group(R > 1 ? rows_of(j, m0, m1) : j, g, 0, j.steps(), nullptr);
    }
  });
}

void run(const Job& j) {
  const int64_t groups = j.epilogue == kSiluMul ? (j.N + kGroup / 2 - 1) / (kGroup / 2) : (j.N + kGroup - 1) / kGroup;
  const int64_t T = std::min<int64_t>(at::get_num_threads(), groups * j.steps());
  if (T > 1 && j.M >= kClaimRows) return run_claimed(j, groups, T);
  if (T <= 1 || groups % T == 0) {
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) run_group(j, g, 0, j.steps(), nullptr);
    });
    return;
  }
  const int64_t K2 = j.steps(), total = groups * K2, slot = j.M * kGroup;
  std::vector<float> parts(static_cast<size_t>(2 * T * slot));  // a thread's first and last group, if cut
  std::vector<int64_t> owner(2 * T, -1);                         // the group each slot holds
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t u0 = t * total / T, u1 = (t + 1) * total / T;
      for (int64_t g = u0 / K2; g * K2 < u1; ++g) {
        const int64_t k0 = std::max(u0, g * K2) - g * K2, k1 = std::min(u1, (g + 1) * K2) - g * K2;
        if (k0 == 0 && k1 == K2) {
          run_group(j, g, 0, K2, nullptr);
          continue;
        }
        const int64_t sl = 2 * t + (g * K2 < u0 ? 0 : 1);
        owner[sl] = g;
        run_group(j, g, k0, k1, parts.data() + sl * slot);
      }
    }
  });
  for (int64_t a = 0; a < 2 * T; ++a) {  // add each cut group's parts into its first slot, then finish
    if (owner[a] < 0) continue;
    for (int64_t b = a + 1; b < 2 * T; ++b)
      if (owner[b] == owner[a]) {
        for (int64_t i = 0; i < slot; ++i) parts[a * slot + i] += parts[b * slot + i];
        owner[b] = -1;
      }
    finish_parts(j, owner[a], parts.data() + a * slot);
  }
}
#endif

void check_product(const torch::Tensor& x, const torch::Tensor& packed, int64_t rows) {
  TORCH_CHECK(has_bf16_linear(), "packed bf16 products need a CPU with AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be [M, K] bf16 on the CPU");
  const bool f32 = packed.scalar_type() == at::kFloat;
  TORCH_CHECK(f32 ? packed.dim() == 3 && packed.size(2) == kGroup && packed.is_contiguous()
                  : packed.dim() == 4 && packed.size(2) == kGroup && packed.size(3) == 2 && packed.is_contiguous() &&
                        packed.scalar_type() == at::kBFloat16,
              "not a packed weight (see pack_bf16, pack_f32)");
  const int64_t K = f32 ? packed.size(1) : 2 * packed.size(1);
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the packed weight ", K);
  TORCH_CHECK(rows > 0 && rows <= packed.size(0) * kGroup, "bad output count ", rows);
}
}  // namespace

bool has_bf16_linear() {
#ifdef ASERVE_BF16_DP
  return true;
#else
  return false;
#endif
}

namespace {
// Row n's KS steps (k-pairs as uint32, or single fp32 ks) to [G, KS, 64]: packed row r of group g
// holds row src_row(g, r) at each step (zero padding stays zero).
template <class T>
void scatter_groups(const T* src, T* dst, int64_t order, int64_t N, int64_t G, int64_t KS) {
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < kGroup; ++r) {
        const int64_t n = src_row(order, N, g, r);
        if (n < 0) continue;
        for (int64_t k = 0; k < KS; ++k) dst[(g * KS + k) * kGroup + r] = src[n * KS + k];
      }
  });
}
}  // namespace

torch::Tensor pack_bf16(torch::Tensor w, int64_t order) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_bf16: w must be [N, K] bf16");
  TORCH_CHECK(w.size(1) % 2 == 0, "pack_bf16: K must be even, got ", w.size(1));
  TORCH_CHECK(order == kOrderPlain || (order == kOrderGateUp && w.size(0) % kGroup == 0),
              "pack_bf16: a gate_up weight needs a multiple of 64 rows");
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), K2 = K / 2, G = (N + kGroup - 1) / kGroup;
  auto out = torch::zeros({G, K2, kGroup, 2}, wc.options());
  const auto* src = reinterpret_cast<const uint32_t*>(wc.data_ptr<bf16>());  // (k, k+1) pairs of a row
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr<bf16>());
  scatter_groups(src, dst, order, N, G, K2);
  return out;
}

torch::Tensor pack_f32(torch::Tensor w, int64_t order) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_f32: w must be [N, K] bf16");
  TORCH_CHECK(order == kOrderPlain || (order == kOrderGateUp && w.size(0) % kGroup == 0),
              "pack_f32: a gate_up weight needs a multiple of 64 rows");
  const auto wc = w.contiguous().to(at::kFloat);
  const int64_t N = wc.size(0), K = wc.size(1), G = (N + kGroup - 1) / kGroup;
  auto out = torch::zeros({G, K, kGroup}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  scatter_groups(src, dst, order, N, G, K);
  return out;
}

#ifdef ASERVE_BF16_DP
namespace {
// The job of x times a packed weight of either kind: an fp32 weight takes x in fp32 (held in xf).
Job make_job(const torch::Tensor& xc, const torch::Tensor& packed, torch::Tensor& xf, int64_t n, int epilogue,
             const float* bias, void* y, bool widen) {
  Job j{xc.data_ptr<bf16>(), static_cast<const bf16*>(packed.data_ptr()), xc.size(0), xc.size(1), n, epilogue, bias, y};
  j.widen = widen && packed.scalar_type() == at::kBFloat16;
  if (packed.scalar_type() == at::kFloat || j.widen) {
    xf = xc.to(at::kFloat).contiguous();
    j.xf = xf.data_ptr<float>();
  }
  return j;
}
}  // namespace
#endif

torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t n, std::optional<torch::Tensor> bias,
                            bool fp32_out, bool widen) {
  check_product(x, packed, n);
  const auto xc = x.contiguous();
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "linear_packed: bias has ", b.numel(), " values for ", n, " outputs");
  }
  auto y = torch::empty({xc.size(0), n}, xc.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
#ifdef ASERVE_BF16_DP
  torch::Tensor xf;
  if (xc.size(0) > 0)
    run(make_job(xc, packed, xf, n, fp32_out ? kStoreF32 : kStore, bias.has_value() ? b.data_ptr<float>() : nullptr,
                 y.data_ptr(), widen));
#endif
  return y;
}

void linear_packed_add_(torch::Tensor y, torch::Tensor x, torch::Tensor packed, bool widen) {
  check_product(x, packed, y.size(1));
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.is_contiguous() && y.scalar_type() == at::kBFloat16,
              "linear_packed_add_: y must be a contiguous bf16 [M, N]");
  const auto xc = x.contiguous();
#ifdef ASERVE_BF16_DP
  torch::Tensor xf;
  if (xc.size(0) > 0) run(make_job(xc, packed, xf, y.size(1), kAddInto, nullptr, y.data_ptr<bf16>(), widen));
#endif
}

torch::Tensor silu_mul_packed(torch::Tensor x, torch::Tensor packed, bool widen) {
  const int64_t I = packed.size(0) * kGroup / 2;
  check_product(x, packed, 2 * I);
  const auto xc = x.contiguous();
  auto y = torch::empty({xc.size(0), I}, xc.options());
#ifdef ASERVE_BF16_DP
  torch::Tensor xf;
  if (xc.size(0) > 0) run(make_job(xc, packed, xf, I, kSiluMul, nullptr, y.data_ptr<bf16>(), widen));
#endif
  return y;
}

double read_pass(torch::Tensor t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "read_pass: a contiguous CPU tensor");
  const char* p = static_cast<const char*>(t.data_ptr());
  const int64_t n = t.numel() * t.element_size() / 256;  // 256-byte steps (as a packed k-pair), floats
  TORCH_CHECK(t.scalar_type() == at::kFloat && n * 256 == t.numel() * 4, "read_pass: fp32, a multiple of 64 values");
  std::vector<float> sums(at::get_num_threads() + 1, 0.f);
  at::parallel_for(0, n, 4096, [&](int64_t a, int64_t b) {
#if defined(__AVX512F__)
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = a; i < b; ++i) {
      const char* q = p + i * 256;
      _mm_prefetch(q + kPrefetchBytes, _MM_HINT_T1), _mm_prefetch(q + kPrefetchBytes + 64, _MM_HINT_T1);
      _mm_prefetch(q + kPrefetchBytes + 128, _MM_HINT_T1), _mm_prefetch(q + kPrefetchBytes + 192, _MM_HINT_T1);
      s0 = _mm512_add_ps(s0, _mm512_loadu_ps(reinterpret_cast<const float*>(q)));
      s1 = _mm512_add_ps(s1, _mm512_loadu_ps(reinterpret_cast<const float*>(q + 64)));
      s2 = _mm512_add_ps(s2, _mm512_loadu_ps(reinterpret_cast<const float*>(q + 128)));
      s3 = _mm512_add_ps(s3, _mm512_loadu_ps(reinterpret_cast<const float*>(q + 192)));
    }
    sums[at::get_thread_num()] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#else
    float s = 0.f;
    for (int64_t i = a; i < b; ++i)
      for (int j = 0; j < 64; ++j) s += reinterpret_cast<const float*>(p + i * 256)[j];
    sums[at::get_thread_num()] += s;
#endif
  });
  double total = 0;  // returned, so the reads cannot be optimised away
  for (float s : sums) total += s;
  return total;
}
