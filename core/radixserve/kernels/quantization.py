"""Quantization methods own how a linear layer's weights are stored and applied."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from radixserve.kernels.base import Backend
from radixserve.kernels.gemm import GemmBackend
from radixserve.kernels.query import KernelQuery


class WeightLoader(Protocol):
    """Copies one checkpoint tensor into ``param``. ``shard_id`` names the part of a
    fused parameter the tensor fills (``"q"``/``"k"``/``"v"`` of a QKV projection,
    ``0``/``1`` for gate/up of a merged projection, ``(expert, "gate"|"up"|"down")``
    for MoE experts); ``None`` means the whole parameter. The loader also takes this
    rank's slice of the tensor under tensor parallelism."""

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None: ...


class QuantizationMethod(Backend):
    """Lifecycle, per linear layer: ``create_weights`` registers parameters (each
    with a ``weight_loader`` attribute the model loader calls), the checkpoint is
    loaded, ``process_weights_after_loading`` converts them (quantize, repack),
    then ``apply`` runs on every forward.
    """

    def __init__(self, query: KernelQuery, gemm: GemmBackend):
        self.query = query
        self.gemm = gemm

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``silu(gate) * up`` of ``apply``'s output in one fused kernel (see
        ``GemmBackend.linear_silu_and_mul``), or None where the method has none
        (the default)."""
        return None

    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        """For a method that loads checkpoints shipped quantized: the tensors one linear
        weight is stored as (their names after the module's: ``qweight``, ``scales``,
        ...), which ``dense_weight`` reads. Empty (the default): the checkpoint stores
        each weight as one float tensor named ``weight``."""
        return ()

    def dense_weight(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One whole linear weight ``[out, in]`` (float32) from its checkpoint tensors
        (``checkpoint_tensor_names``), dequantized: how the experts of a quantized
        mixture-of-experts checkpoint load (they run in the model's dtype)."""
        raise NotImplementedError(f"{type(self).__name__} does not read quantized checkpoint tensors")
