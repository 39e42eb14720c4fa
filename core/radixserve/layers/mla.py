"""Multi-head latent attention layers (see radixserve/kernels/mla.py): the latent's
per-head up-projection weight, and the attention call into ``ctx.attention``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixserve.forward_batch import ForwardBatch
from radixserve.kernels import MLAAttentionBackend, MLALayerSpec
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer
from radixserve.layers.parallel import divide
from radixserve.layers.weights import copy_into, set_weight_loader


class LatentUpProjection(Layer):
    """``kv_b_proj``: per head, ``W_UK`` (``qk_nope_head_dim`` rows) then ``W_UV``
    (``v_head_dim`` rows) over the latent, ``[heads * (nope + v), kv_lora_rank]``
    as in the checkpoint, this rank's heads. A plain weight, never quantized or
    packed: the attention backend reads it per head (``per_head``), up-projecting
    the latent or absorbing it into the query and the output."""

    def __init__(self, num_heads: int, qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int, ctx: ModelContext):
        super().__init__()
        self.ctx = ctx
        self.num_heads = divide(num_heads, ctx.tp_size)
        self.head_rows = qk_nope_head_dim + v_head_dim
        self.weight = nn.Parameter(
            torch.empty(self.num_heads * self.head_rows, kv_lora_rank, dtype=ctx.dtype), requires_grad=False
        )
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        rows = param.shape[0]
        copy_into(param.data, loaded.narrow(0, self.ctx.tp_rank * rows, rows))

    def per_head(self) -> torch.Tensor:
        """``[heads, nope + v, kv_lora_rank]`` (a view)."""
        return self.weight.view(self.num_heads, self.head_rows, -1)


class MultiHeadLatentAttention(Layer):
    """Stores the new tokens' latent entries and attends over each request's
    cached and new tokens through ``ctx.attention.forward_mla``; the output is
    ``[T, heads * v_head_dim]`` (this rank's heads)."""

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scaling: float,
        ctx: ModelContext,
    ):
        super().__init__()
        if not isinstance(ctx.attention, MLAAttentionBackend):
            raise ValueError(
                f"the model uses multi-head latent attention, which attention backend {ctx.attention.name!r} "
                "does not serve"
            )
        self.spec = MLALayerSpec(
            layer_id=layer_id,
            num_heads=divide(num_heads, ctx.tp_size),
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            scaling=scaling,
        )
        self.backend: MLAAttentionBackend = ctx.attention

    def forward(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_b_weight: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        out = self.backend.forward_mla(q_nope, q_rope, latent, k_rope, kv_b_weight, self.spec, batch)
        return out.reshape(-1, self.spec.num_heads * self.spec.v_head_dim)

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"layer_id={s.layer_id}, heads={s.num_heads}, kv_lora_rank={s.kv_lora_rank}, "
            f"qk_nope={s.qk_nope_head_dim}, qk_rope={s.qk_rope_head_dim}, v={s.v_head_dim}"
        )
