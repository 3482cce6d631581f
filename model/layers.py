"""Small building blocks shared by the model families: RMSNorm, rotary embedding."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm: normalise in float32, cast back, then scale (as the reference does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the "rotate half" layout HF LLaMA checkpoints use).

    cos/sin tables are built once in float32 for every position up to ``max_position`` and
    indexed by each token's absolute position, so chunks and decode tokens need no offsets.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_position, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        # q: [T, H, D], k: [T, H_kv, D], positions: [T]
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
