"""What a model is built with: the selected backends and its parallel rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from radixserve.kernels import (
    AttentionBackend,
    ElementwiseBackend,
    GemmBackend,
    KernelQuery,
    MoEBackend,
    QuantizationMethod,
)


@dataclass
class ModelContext:
    attention: AttentionBackend
    gemm: GemmBackend
    quant: QuantizationMethod
    moe: Optional[MoEBackend]
    elementwise: ElementwiseBackend  # norms, rotary, the MLP activation
    dtype: torch.dtype
    device: torch.device
    tp_rank: int = 0
    tp_size: int = 1
    # torch.distributed process group of the TP ranks; None means the default group.
    tp_group: Any = None

    @classmethod
    def create(
        cls,
        registry: Any,
        query: KernelQuery,
        device: torch.device,
        *,
        attention: str = "auto",
        gemm: str = "auto",
        moe: str = "auto",
        elementwise: str = "auto",
        quantization: Optional[str] = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ) -> "ModelContext":
        """Select and instantiate every backend for ``query`` through ``registry``
        (a :class:`radixserve.registry.PluginRegistry`). The MoE backend is only
        selected when the query names experts; ``quantization=None`` means ``none``."""
        gemm_backend = registry.select("gemm", query, gemm)(query)
        quant_cls = registry.select("quantization", query, quantization or "none")
        moe_backend = registry.select("moe", query, moe)(query) if query.num_experts else None
        return cls(
            attention=registry.select("attention", query, attention)(query),
            gemm=gemm_backend,
            quant=quant_cls(query, gemm_backend),
            moe=moe_backend,
            elementwise=registry.select("elementwise", query, elementwise)(query),
            dtype=query.dtype,
            device=device,
            tp_rank=tp_rank,
            tp_size=tp_size,
            tp_group=tp_group,
        )
