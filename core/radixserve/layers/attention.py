"""Paged attention layer: per-layer constants plus a call into ``ctx.attention``."""

from __future__ import annotations

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.kernels import AttentionLayerSpec
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer


class PagedAttention(Layer):
    """Writes the new tokens' K/V into the KV pool and attends over each request's
    cached and new tokens; the backend does both (see ``AttentionBackend``).

    Head counts are this rank's. Inputs are flat ``[T, heads * head_dim]`` or
    already ``[T, heads, head_dim]``; the output is ``[T, num_heads * head_dim]``.
    """

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        ctx: ModelContext,
        scaling: float | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ):
        super().__init__()
        self.spec = AttentionLayerSpec(
            layer_id=layer_id,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scaling=head_dim**-0.5 if scaling is None else scaling,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
        self.backend = ctx.attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        spec = self.spec
        q = q.reshape(-1, spec.num_heads, spec.head_dim)
        k = k.reshape(-1, spec.num_kv_heads, spec.head_dim)
        v = v.reshape(-1, spec.num_kv_heads, spec.head_dim)
        out = self.backend.forward(q, k, v, spec, batch)
        return out.reshape(-1, spec.num_heads * spec.head_dim)

    def extra_repr(self) -> str:
        s = self.spec
        text = f"layer_id={s.layer_id}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}"
        if s.sliding_window is not None:
            text += f", sliding_window={s.sliding_window}"
        if s.logit_softcap is not None:
            text += f", logit_softcap={s.logit_softcap}"
        return text
