"""``fp8`` / ``fp8_per_tensor``: w8a8 with float8 e4m3 weights and activations
through ``torch._scaled_mm`` (cuBLASLt / CUTLASS fp8 tensor cores, compute
capability >= 8.9).

Semantics (the conformance kit's ``QUANT_REFERENCES`` states them independently):

* weights, quantized at load time from the float checkpoint: ``scale_w =
  max|w| / 448`` per output channel (``fp8``) or over the whole matrix
  (``fp8_per_tensor``), ``w8 = e4m3(clamp(w / scale_w, -448, 448))``;
* activations, quantized on every forward, per token (row):
  ``scale_x = max|x_row| / 448``, ``x8 = e4m3(clamp(x / scale_x, -448, 448))``;
* ``y = (x8 * scale_x) @ (w8 * scale_w).T + bias``, accumulated in float32,
  returned in the activation dtype (bfloat16 or float16).

All scale arithmetic runs in float32. ``torch._scaled_mm`` gets both scales
row-wise (``[M, 1]`` and ``[1, N]``; a per-tensor weight scale is broadcast to
``[1, N]`` once at load time).
"""

from __future__ import annotations

from typing import ClassVar, cast

import torch
from torch import nn

from radixserve.kernels import KernelQuery, QuantizationMethod
from radixserve.kernels.quantization import WeightLoader
from radixserve_cuda.capability import capability_reasons, visible_capabilities

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_CAPABILITY = (8, 9)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
_ALIGN = 16  # fp8 GEMMs need both matrix dims of the weight divisible by 16
_TINY = 1e-12  # an all-zero row or matrix gets this amax instead of a zero scale


def weight_scales(weight: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """Float32 scales of ``weight`` ``[N, K]``: ``[N]`` per output channel, or ``[1]``."""
    w = weight.float().abs()
    amax = w.amax(dim=1) if per_channel else w.amax().reshape(1)
    return amax.clamp(min=_TINY) / FP8_MAX


def token_scales(x: torch.Tensor) -> torch.Tensor:
    """Float32 per-token scales ``[M, 1]`` of activations ``x`` ``[M, K]``."""
    return x.float().abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / FP8_MAX


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(x / scale, -448, 448))``, the division in float32."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``q * scale`` (``scale`` broadcast against ``q``'s rows)."""
    return q.float() * scale


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale_b: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x`` ``[..., K]`` -> ``[..., N]`` with ``qweight`` e4m3 ``[N, K]`` and its
    float32 row-wise scale ``scale_b`` ``[1, N]``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    scale_a = token_scales(x2)
    y = torch._scaled_mm(quantize(x2, scale_a), qweight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], qweight.shape[0])


class Fp8W8A8(QuantizationMethod):
    """fp8 w8a8, per-output-channel weight scales, dynamic per-token activation scales."""

    name = "fp8"
    priority = 0
    per_channel: ClassVar[bool] = True

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        reasons = []
        if query.device != "cuda":
            reasons.append(f"fp8 w8a8 runs on the cuda platform (torch._scaled_mm), not {query.device!r}")
        if query.dtype not in ACTIVATION_DTYPES:
            reasons.append(
                f"fp8 w8a8 serves bfloat16 or float16 models (torch._scaled_mm's row-wise scaling "
                f"returns 16-bit outputs), not {query.dtype}; use --dtype bfloat16"
            )
        if not reasons:
            reasons += capability_reasons(visible_capabilities(), MIN_CAPABILITY, "fp8 w8a8 (torch._scaled_mm)")
        return reasons

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype), requires_grad=False)
        weight.weight_loader = weight_loader  # type: ignore[attr-defined]  # an ad hoc attribute torch's stubs lack
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = cast(torch.Tensor, layer.weight)
        out_features, in_features = weight.shape
        if out_features % _ALIGN or in_features % _ALIGN:
            raise ValueError(
                f"quantization: {self.name} needs a linear layer's in and out features divisible by "
                f"{_ALIGN} (torch._scaled_mm), got out={out_features}, in={in_features}"
            )
        scale = weight_scales(weight.data, self.per_channel)
        qweight = quantize(weight.data, scale[:, None])
        del layer.weight
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("weight_scale", scale.expand(out_features).reshape(1, out_features).contiguous())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.weight_scale), bias)


class Fp8W8A8PerTensor(Fp8W8A8):
    """fp8 w8a8 with one weight scale per matrix (as most fp8 checkpoints ship)."""

    name = "fp8_per_tensor"
    per_channel = False
