"""The one frozen, hashable query every backend candidate is asked about."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.cache.memory_pool import LatentKV


@dataclass(frozen=True)
class KernelQuery:
    """What the model needs from a kernel backend.

    Fields that do not apply to a kind stay ``None``; a candidate only looks at
    the fields its kind uses.
    """

    device: str
    dtype: torch.dtype
    head_dim: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    page_size: int = 1
    kv_dtype: Optional[torch.dtype] = None
    num_experts: Optional[int] = None
    top_k: Optional[int] = None
    quantization: Optional[str] = None
    # Attention features some layers use (the widest window; the cap): a backend
    # without them refuses the query. Per-layer values are on AttentionLayerSpec.
    sliding_window: Optional[int] = None
    logit_softcap: Optional[float] = None
    # The elementwise ops beyond the common three that the model calls (names from
    # kernels.elementwise.MODEL_SPECIFIC_OPS): a backend without one refuses the query.
    elementwise_ops: Optional[tuple[str, ...]] = None
    # Multi-head latent attention (DeepSeek-V2): the KV pool holds one latent entry
    # per token (LatentKV) instead of K and V; only backends that declare MLA serve it.
    mla: Optional[LatentKV] = None

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.__dict__.items() if v is not None]
        return ", ".join(parts)
