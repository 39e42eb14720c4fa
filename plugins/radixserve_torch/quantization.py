from __future__ import annotations

from typing import cast

import torch
from torch import nn

from radixserve.kernels import KernelQuery, QuantizationMethod
from radixserve.kernels.quantization import WeightLoader


class NoQuantization(QuantizationMethod):
    name = "none"
    priority = 0

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
        # The GEMM backend may repack the weight for its kernels (onednn does); it
        # replaces the dense one, so the model holds one copy.
        dense = cast(torch.Tensor, layer.weight).data
        prepared = self.gemm.prepare_weight(dense)
        if prepared is not dense:
            layer.weight = nn.Parameter(prepared, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemm.linear(x, cast(torch.Tensor, layer.weight), bias)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return self.gemm.linear_silu_and_mul(x, cast(torch.Tensor, layer.weight), bias)


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (int8 weight, float32 scale [out])."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (qweight.float() * scale[:, None]).to(dtype)


class Int8WeightOnly(QuantizationMethod):
    """w8a16: weights quantized per output channel at load time; activations stay
    in the model dtype and the product runs on the dequantized weight."""

    name = "int8"
    priority = 0

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return []

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
        qweight, scale = quantize_int8_per_channel(cast(torch.Tensor, layer.weight).data)
        del layer.weight
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("weight_scale", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, scale = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.weight_scale)
        weight = dequantize_int8(qweight, scale, x.dtype)
        return self.gemm.linear(x, weight, bias)
