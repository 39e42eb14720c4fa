"""``torch_native``: the elementwise ops in plain PyTorch, op for op as
HuggingFace's modeling code computes them, so greedy tokens match transformers.

Each op rounds where HF rounds (the residual add and the rotary products in the
model dtype, the norm in float32), which makes this the numerical ground truth
the conformance kit compares other backends against. It is also the CPU
default, where decode pays per torch call: work is done in place where the
contract allows it (the residual add, rotary), and q and k of one fused QKV
output turn together in one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.kernels import MODEL_SPECIFIC_OPS, ElementwiseBackend, KernelQuery, elementwise_op_reasons
from radixserve.kernels.elementwise import NormResult


class TorchNativeElementwise(ElementwiseBackend):
    name = "torch_native"
    priority = 0

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return elementwise_op_reasons(query, cls.name, MODEL_SPECIFIC_OPS)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> NormResult:
        if residual is None:
            return weight * _normalize(x, eps)
        residual.add_(x)  # HF: hidden = residual + hidden, in the model dtype
        return torch.mul(weight, _normalize(residual, eps), out=x), residual

    def apply_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        neox_style: bool = True,
    ) -> None:
        rotary_dim = cos_sin_cache.shape[-1]
        cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(-2).chunk(2, dim=-1)  # [T, 1, rot/2]
        targets = [qk] if (qk := _joined(q, k)) is not None else [q, k]
        if neox_style:  # HF's own expression, x * cos + rotate_half(x) * sin, computed in place
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            for x in targets:
                _rotate_neox_(x[..., :rotary_dim], cos, sin)
        else:
            for x in targets:
                _rotate_pairs_(x[..., :rotary_dim], cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gemma_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> NormResult:
        if residual is None:
            return _gemma_normalize(x, weight, eps)
        residual.add_(x)
        return _gemma_normalize(residual, weight, eps), residual

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` in float32, cast back to ``x.dtype``."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _gemma_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Gemma RMSNorm: ``(x * rsqrt(mean(x^2) + eps)) * (1 + weight)`` in
    float32, one rounding to ``x.dtype`` at the end."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.mul_(1.0 + weight.float()).to(x.dtype)


def _joined(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one ``[T, heads + kv_heads, D]`` view when k's heads follow q's
    in memory with the same strides (the q and k parts of one fused QKV
    output), so both turn in one pass: half the torch calls at decode."""
    if (
        q.dtype == k.dtype
        and q.shape[0] == k.shape[0]
        and q.shape[2] == k.shape[2]
        and q.stride()[1:] == k.stride()[1:]
        and (q.shape[0] == 1 or q.stride(0) == k.stride(0))  # a single token's stride is arbitrary
        and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        and k.storage_offset() == q.storage_offset() + q.shape[1] * q.stride(1)
    ):
        return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride(), q.storage_offset())
    return None


def _rotate_neox_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``x = x * cos + rotate_half(x) * sin`` in place (cos/sin ``[T, 1, rot]``),
    each product and the sum rounded to the dtype as in HF: fewest ops on CPU."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1).mul_(sin)
    x.mul_(cos).add_(rotated)


def _rotate_pairs_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """GPT-J style: pairs ``(x[2i], x[2i + 1])`` turn by cos/sin ``[T, 1, rot/2]``, in place."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    x1.copy_(out1)
    x2.copy_(out2)
