// Declarations shared by aserve's CPU kernels; the Python module is defined in paged_attention.cpp.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <vector>

// y = x @ w.T (+ bias) for a few rows of bf16 x [M, K] against bf16 w [N, K], reading w once.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias);
// True where this build has the AVX512-BF16 dot products linear_bf16 needs.
bool has_bf16_linear();
// Decode attention reading K/V in place from the block pool: q [B, H, D] -> [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor ctx_lens, double scale);
// A whole decode-only step of a LLaMA model in bf16, embeddings in, final-normed hidden out
// (llama_decode.cpp has the argument layout).
torch::Tensor llama_decode(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> layers,
                           torch::Tensor final_norm, torch::Tensor kv, torch::Tensor slots, torch::Tensor tables,
                           torch::Tensor ctx_lens, int64_t num_heads, double eps, double scale, int64_t native_rows);
