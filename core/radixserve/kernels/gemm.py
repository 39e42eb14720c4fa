"""Dense matrix multiply: ``y = x @ weight.T + bias``."""

from __future__ import annotations

import torch

from radixserve.kernels.base import Backend
from radixserve.kernels.query import KernelQuery


class GemmBackend(Backend):
    def __init__(self, query: KernelQuery):
        self.query = query

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight in the form ``linear`` reads fastest, made once after loading.

        Called by quantization methods that keep a dense ``[out, in]`` weight
        (``none``) with the loaded weight; what it returns replaces that weight
        in the layer, so the dense copy is freed. A backend that repacks (for
        example into its library's blocked layout, so no call reorders it again)
        returns the packed tensor; the default returns ``weight`` itself.
        """
        return weight

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: ``[..., in]``; ``weight``: ``[out, in]``, dense or as ``prepare_weight``
        returned it (quantization methods that dequantize per call pass dense
        weights); returns ``[..., out]``."""
        raise NotImplementedError

    def linear_silu_and_mul(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """``silu(gate) * up`` of ``linear(x, weight, bias)``, whose first half of
        out features is ``gate`` and second half ``up`` (an MLP's fused gate/up
        projection), in one kernel that never writes the projection itself
        (``[..., out / 2]``); rounded as ``linear`` and then the elementwise
        ``silu_and_mul`` round. A backend without such a kernel for these operands
        returns None (the default), and the layer runs ``linear`` and then the
        elementwise backend's ``silu_and_mul``."""
        return None
