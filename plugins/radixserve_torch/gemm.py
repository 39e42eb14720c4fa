from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from radixserve.kernels import GemmBackend


class TorchGemm(GemmBackend):
    name = "torch"
    priority = 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return F.linear(x, weight, bias)
