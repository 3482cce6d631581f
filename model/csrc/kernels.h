// Declarations shared by aserve's CPU kernels; the Python module is defined in paged_attention.cpp.
#pragma once
#include <torch/extension.h>

#include <optional>

// y = x @ w.T (+ bias) for a few rows of bf16 x [M, K] against bf16 w [N, K], reading w once.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias);
// True where this build has the AVX512-BF16 dot products linear_bf16 needs.
bool has_bf16_linear();
