"""Quantization methods own how a linear layer's weights are stored and applied."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from radixserve.kernels.base import Backend
from radixserve.kernels.gemm import GemmBackend
from radixserve.kernels.query import KernelQuery

WeightLoader = Callable[[nn.Parameter, torch.Tensor], None]


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

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError
