"""Dense matrix multiply: ``y = x @ weight.T + bias``."""

from __future__ import annotations

from typing import Optional

import torch

from radixserve.kernels.base import Backend
from radixserve.kernels.query import KernelQuery


class GemmBackend(Backend):
    def __init__(self, query: KernelQuery):
        self.query = query

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x``: ``[..., in]``; ``weight``: ``[out, in]``; returns ``[..., out]``."""
        raise NotImplementedError
