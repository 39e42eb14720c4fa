"""RMSNorm with HuggingFace's numerics: normalise in float32, cast back, then scale."""

from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.context import ModelContext


class RMSNorm(nn.Module):
    """Normalises over the last dimension, so it serves both whole hidden states
    ``[T, H]`` and per-head q/k norms ``[T, heads, head_dim]``."""

    def __init__(self, hidden_size: int, eps: float, ctx: ModelContext):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
