"""What a model is built with: the selected backends and its parallel rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.kernels import AttentionBackend, GemmBackend, MoEBackend, QuantizationMethod


@dataclass
class ModelContext:
    attention: AttentionBackend
    gemm: GemmBackend
    quant: QuantizationMethod
    moe: Optional[MoEBackend]
    dtype: torch.dtype
    device: torch.device
    tp_rank: int = 0
    tp_size: int = 1
