"""RMSNorm through ``ctx.elementwise``, with HuggingFace's numerics (see
:class:`radixserve.kernels.ElementwiseBackend`): the residual add fused in,
normalise in float32, cast back, then scale; and Gemma's, which scales by
``1 + weight`` in float32 before the cast."""

from __future__ import annotations

import torch
from torch import nn

from radixserve.kernels.elementwise import NormResult
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer


class RMSNorm(Layer):
    """Normalises over the last dimension, so it serves both whole hidden states
    ``[T, H]`` and per-head q/k norms ``[T, heads, head_dim]``.

    ``norm(x)`` returns the normalised tensor; ``norm(x, residual)`` first adds
    ``x`` to the residual stream and returns ``(normed, new_residual)``, reusing
    the storage of both inputs where the backend can (use only the results)."""

    def __init__(self, hidden_size: int, eps: float, ctx: ModelContext):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.backend = ctx.elementwise

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> NormResult:
        return self.backend.rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm (``ElementwiseBackend.gemma_rms_norm``): the checkpoint's
    weight is an offset from 1, applied in float32 before the cast. Called like
    :class:`RMSNorm`."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> NormResult:
        return self.backend.gemma_rms_norm(x, self.weight, self.eps, residual)
