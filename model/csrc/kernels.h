// Declarations and SIMD helpers shared by aserve's CPU kernels; the Python module is defined in
// paged_attention.cpp.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// How pack_bf16 orders a weight's rows: as they are, or a fused gate_up weight [2 I, K] whose
// groups each take 32 gate rows and the 32 matching up rows (for silu_mul_packed).
constexpr int64_t kOrderPlain = 0, kOrderGateUp = 1;

// True where this build has the AVX512-BF16 dot products the packed products need.
bool has_bf16_linear();
// w [N, K] bf16 -> the packed layout of gemm_bf16.cpp, [ceil(N / 64), K / 2, 64, 2].
torch::Tensor pack_bf16(torch::Tensor w, int64_t order);
// w [N, K] bf16 -> the same groups in fp32, [ceil(N / 64), K, 64]: the products below take either
// packed kind (an fp32 one with x widened to fp32, and FMAs instead of bf16 dot products).
torch::Tensor pack_f32(torch::Tensor w, int64_t order);
// x [M, K] bf16 @ w.T (+ bias) with w packed plain; n = w's row count. Returns [M, n] bf16, or
// the fp32 sums unrounded with fp32_out. widen (the three products): a bf16-packed w is widened
// to fp32 in registers and multiplied with FMAs, as an fp32-packed one is (ignored for fp32 w).
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t n, std::optional<torch::Tensor> bias,
                            bool fp32_out = false, bool widen = false);
// y [M, N] += bf16(x @ w.T), w packed plain: a linear and a residual add in one pass.
void linear_packed_add_(torch::Tensor y, torch::Tensor x, torch::Tensor packed, bool widen = false);
// silu(x @ gate.T) * (x @ up.T) with the gate_up weight packed kOrderGateUp: [M, I] bf16.
torch::Tensor silu_mul_packed(torch::Tensor x, torch::Tensor packed, bool widen = false);
// True where this build has the AVX2 FMA products of fp32 x (linear_f32).
bool has_f32_linear();
// w [N, K] fp32 (or bf16) -> groups of 32 outputs, one k a step, [ceil(N / 32), K, 32] fp32.
torch::Tensor pack_f32x32(torch::Tensor w);
// x [M, K] fp32 @ w.T (+ bias) with w packed by pack_f32x32; n = w's row count. Returns [M, n] fp32
// (gemm_f32.cpp: an fp32 model's small-row products on CPUs without AVX512-BF16).
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor packed, int64_t n, std::optional<torch::Tensor> bias);
// RMSNorm of x's rows (fp32, the last dimension w's size) scaled by w: x / sqrt(mean(x^2) + eps) * w.
torch::Tensor rms_norm_f32(torch::Tensor x, torch::Tensor w, double eps);
// RoPE of x [T, heads, D] fp32 with cos and the signed sin [T, (1,) D]: x * cos + rotate_half(x) * sin.
torch::Tensor rope_f32(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
// Reads every byte of t once (256 bytes a step, asked into L2 ahead as the products do) and
// returns a sum of them: the memory probe of `aserve bench engine`.
double read_pass(torch::Tensor t);
// Decode attention reading K/V in place from the block pool: q [B, H, D] -> [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor ctx_lens, double scale);
// The bf16 fast path of paged_decode (paged_decode_bf16.cpp): fills out and returns true, or
// returns false where it does not apply (dtype, head size, heads per KV head, no AVX512-BF16).
bool paged_decode_bf16(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& tables, const torch::Tensor& ctx_lens, double scale, torch::Tensor& out);
// Causal attention of prompt chunks over the pool (paged_prefill_bf16.cpp): fills the chunks'
// rows of out and returns true, or returns false where it does not apply (dtype, head layout).
bool paged_prefill_bf16(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& seqs, const torch::Tensor& tables, double scale, torch::Tensor& out);
// A whole forward step of a LLaMA model in bf16, embeddings in, final-normed hidden out (and
// tapped rows after a given layer): prompt chunks and decode tokens (llama_forward.cpp has the
// argument layout).
std::vector<torch::Tensor> llama_forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                         std::vector<torch::Tensor> layers, torch::Tensor final_norm, torch::Tensor kv,
                                         torch::Tensor slots, torch::Tensor seqs, torch::Tensor seq_tables,
                                         torch::Tensor dec_tables, torch::Tensor dec_lens, int64_t num_heads, double eps,
                                         double scale, int64_t tap_layer, torch::Tensor tap_rows, bool widen = false);

// 2^f for f in [-0.5, 0.5]: the degree-7 Taylor polynomial's coefficients, highest first (Horner)
constexpr float kExp2Poly[8] = {1.525273380405984e-05f, 1.540353039338161e-04f, 1.333355814642844e-03f,
                                9.618129107628477e-03f, 5.550410866482158e-02f, 2.402265069591007e-01f,
                                6.931471805599453e-01f, 1.f};

#if defined(__AVX512F__)
// 16 bf16 values -> 16 fp32 (a bf16 is the top half of an fp32: exact)
inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// e^x, 16 lanes: 2^(x log2 e) split into an integer power (applied exactly by scalef) and a
// fraction in [-0.5, 0.5] whose 2^f is a degree-7 Taylor polynomial (relative error below
// 1e-8). Below -104 the result is 0 or a denormal; large x overflows to inf, as expf does.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 7
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}
#endif
