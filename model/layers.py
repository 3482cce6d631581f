"""Small building blocks shared by the model families: Linear, RMSNorm, rotary embedding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import native
from model.native import linear


class Linear(nn.Linear):
    """``nn.Linear`` whose bf16 calls on a CPU go to our packed kernel (``model.native.linear``)
    unless the model uses the fallback (``native`` False, set by ``native.use_kernels``);
    everything else is torch's own. Same parameters, same names."""

    native = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.native)


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm (float32 accumulation, as the reference); an fp32 one on a CPU through our
    one-call kernel (``model.native.rms_norm``) unless the model uses the fallback."""

    native = True

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            if self.native and native.f32_op_applies(x, self.weight):
                return native.rms_norm(x, self.weight, self.eps)
            # torch's fused CPU kernel accumulates in float32 and matches the reference to one
            # bf16 rounding: one op instead of eight on the decode hot path
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # on CUDA the fused bf16 kernel drifted far enough to change greedy answers (measured on
        # an H100 with torch 2.11): normalise in float32, cast back, then scale, as HF does. The
        # float32 normalisation is torch's one op (HF's five: pow, mean, add, rsqrt, mul), which
        # matters on a GPU, where a decode step is bound by how many kernels it launches
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the "rotate half" layout HF LLaMA checkpoints use).

    cos/sin tables are built once in float32 for every position up to ``max_position``;
    ``tables(positions)`` is looked up once per step and shared by all layers, so chunks and
    decode tokens need no offsets and each layer pays only four elementwise ops.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, D/2]
        self.register_buffer("cos", torch.cat([freqs, freqs], -1).cos(), persistent=False)  # [max_position, D]
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin, sin): fold the sign into the table
        self.register_buffer("sin", torch.cat([-freqs.sin(), freqs.sin()], -1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, signed sin: [T, 1, D] in ``dtype`` for the step's positions."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native_ok: bool = False) -> torch.Tensor:
    """x: [T, heads, D] (q and k heads together) -> rotated, same shape. ``native_ok``: an fp32 CPU
    x goes through our one-call kernel (``model.native.rope``)."""
    if native_ok and native.f32_op_applies(x, cos):
        return native.rope(x, cos, sin)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin
