"""Attention over the paged KV pool: the interface every attention backend implements."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels.base import Backend
from radixserve.kernels.query import KernelQuery


@dataclass(frozen=True)
class AttentionLayerSpec:
    """The per-layer constants a backend needs (one per attention layer)."""

    layer_id: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    scaling: float  # softmax scale, usually head_dim ** -0.5


class AttentionBackend(Backend):
    """Computes causal attention for the new tokens of a ForwardBatch.

    ``forward`` first stores the new tokens' K and V into the KV pool at
    ``batch.out_cache_loc`` for ``layer.layer_id``, then attends each new query
    to all ``seq_lens[i]`` tokens of its request (prefix + new, causally).
    Shapes: q ``[num_tokens, num_heads, head_dim]``, k/v
    ``[num_tokens, num_kv_heads, head_dim]``; returns
    ``[num_tokens, num_heads, head_dim]``.
    """

    def __init__(self, query: KernelQuery):
        self.query = query

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Called once per step before the layers run; fill ``batch.attn_metadata``."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        if batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, layer, batch)
        return self.forward_extend(q, layer, batch)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError
