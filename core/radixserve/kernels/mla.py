"""Multi-head latent attention (DeepSeek-V2's MLA): the interface of the attention
backends that serve it.

An MLA model keeps no K and V per head. Per token and layer it stores one entry
that every head shares (``LatentKV``, in a ``LatentKVPool``): the compressed
latent ``c`` (``kv_lora_rank`` values) and the key's rotary part ``k_rope``
(``rope_dim`` values). Head ``h`` reads them through the up-projection
``kv_b_weight[h]`` (``W_UK[h]``: ``qk_nope_head_dim`` rows, then ``W_UV[h]``:
``v_head_dim`` rows, each over the latent):

    key    k_h(s) = [W_UK[h] c(s) ; k_rope(s)]
    value  v_h(s) = W_UV[h] c(s)
    query  q_h(t) = [q_nope_h(t) ; q_rope_h(t)]
    out_h(t) = sum over the request's tokens s <= t of softmax_s(scaling * q_h(t) . k_h(s)) v_h(s)

The same numbers come out of attention over the latent itself ("absorbed"):
``q_h . k_h(s) = (W_UK[h]^T q_nope_h) . c(s) + q_rope_h . k_rope(s)`` and
``out_h = W_UV[h] sum_s p_s c(s)``: one shared entry of ``kv_lora_rank + rope_dim``
values per key for all heads, at the price of ``kv_lora_rank``-wide dot
products. Which form a backend computes is its choice (radixserve_torch's
``torch_mla`` and radixserve_triton's ``triton_mla``: up-projected for extend,
absorbed for decode). ``up_projected_extend`` is the up-projected extend in
plain torch, shared by backends as ``route`` is by the MoE backends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.cache.memory_pool import LatentKVPool
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels.attention import AttentionBackend, AttentionLayerSpec, attention_feature_reasons
from radixserve.kernels.query import KernelQuery


@dataclass(frozen=True)
class MLALayerSpec:
    """The per-layer constants of a multi-head latent attention layer (this rank's heads)."""

    layer_id: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scaling: float  # softmax scale (DeepSeek's YaRN folds its mscale in)


class MLAAttentionBackend(AttentionBackend):
    """An attention backend for multi-head latent attention models (``query.mla``
    set); it serves no other (see :func:`mla_reasons`). The pool is a
    ``LatentKVPool``, token-major.

    ``forward_mla`` first stores the new tokens' entries (``store_latent``: the
    latent, then the rotary key part, at ``batch.out_cache_loc``), then computes
    the attention of the module docstring for every new token over its request's
    cached and new tokens, causally. Shapes: ``q_nope`` ``[T, H, qk_nope_head_dim]``,
    ``q_rope`` ``[T, H, qk_rope_head_dim]`` (rotated), ``latent``
    ``[T, kv_lora_rank]`` (normalised), ``k_rope`` ``[T, qk_rope_head_dim]``
    (rotated), ``kv_b_weight`` ``[H, qk_nope_head_dim + v_head_dim, kv_lora_rank]``;
    returns ``[T, H, v_head_dim]`` in ``q_nope.dtype``. Inputs may be strided
    views (of one projection's output); the last dimension is contiguous.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        raise TypeError(f"attention backend {self.name!r} serves multi-head latent attention only: call forward_mla")

    def forward_mla(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_b_weight: torch.Tensor,
        layer: MLALayerSpec,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        self.store_latent(latent, k_rope, layer, batch)
        if batch.mode is ForwardMode.DECODE:
            return self.forward_mla_decode(q_nope, q_rope, kv_b_weight, layer, batch)
        return self.forward_mla_extend(q_nope, q_rope, kv_b_weight, layer, batch)

    def store_latent(
        self, latent: torch.Tensor, k_rope: torch.Tensor, layer: MLALayerSpec, batch: ForwardBatch
    ) -> None:
        """Write the new tokens' entries into the pool (converted to its dtype); a
        backend with a store kernel of its own overrides this."""
        latent_pool(batch).set_latent(layer.layer_id, batch.out_cache_loc, latent, k_rope)

    def forward_mla_extend(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_b_weight: torch.Tensor,
        layer: MLALayerSpec,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """By default the up-projected extend (:func:`up_projected_extend`, HF's
        own computation); a backend with an extend kernel of its own overrides it."""
        return up_projected_extend(q_nope, q_rope, kv_b_weight, layer, batch)

    def forward_mla_decode(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_b_weight: torch.Tensor,
        layer: MLALayerSpec,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        raise NotImplementedError


def mla_reasons(query: KernelQuery, name: str) -> list[str]:
    """Why MLA backend ``name`` cannot serve ``query``: a model without multi-head
    latent attention, or attention features it lacks (windows, score caps)."""
    if query.mla is None:
        return [f"{name} serves multi-head latent attention only (the model has none)"]
    return attention_feature_reasons(query, name, mla=True)


def latent_pool(batch: ForwardBatch) -> LatentKVPool:
    """The batch's KV pool, which for an MLA model is a ``LatentKVPool``."""
    pool = batch.kv_pool
    if not isinstance(pool, LatentKVPool):
        raise TypeError(f"multi-head latent attention needs a LatentKVPool, got {type(pool).__name__}")
    return pool


def up_projected_extend(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_b_weight: torch.Tensor,
    layer: MLALayerSpec,
    batch: ForwardBatch,
) -> torch.Tensor:
    """An extend step in the up-projected form, in plain torch: every request's
    entries (cached prefix and new tokens, already stored) are gathered and
    expanded through ``kv_b_weight`` into per-head keys ``[W_UK c ; k_rope]`` and
    values ``W_UV c`` (one GEMM for the whole batch, transformers' own
    ``kv_b_proj``), then each request's new tokens attend to them causally.
    Returns ``[T, H, v_head_dim]``."""
    entries = latent_pool(batch).get_latent(layer.layer_id)
    heads, nope, v_dim = layer.num_heads, layer.qk_nope_head_dim, layer.v_head_dim
    slots = torch.cat([batch.req_to_token[batch.req_pool_indices[i], :s] for i, s in enumerate(batch.seq_lens_cpu)])
    context = entries.index_select(0, slots).to(q_nope.dtype)
    latent, k_rope = context[:, : layer.kv_lora_rank], context[:, layer.kv_lora_rank :]
    kv = F.linear(latent, kv_b_weight.flatten(0, 1)).view(-1, heads, nope + v_dim)
    k_nope, values = kv[..., :nope], kv[..., nope:]
    keys = torch.cat((k_nope, k_rope.unsqueeze(1).expand(-1, heads, -1)), dim=-1)  # [S, H, nope + rope]
    queries = torch.cat((q_nope, q_rope), dim=-1)  # [T, H, nope + rope]
    out = q_nope.new_empty((q_nope.shape[0], heads, v_dim))
    first_key = 0
    for i, start in enumerate(batch.extend_start_loc):
        n, seq_len = batch.extend_lens_cpu[i], batch.seq_lens_cpu[i]
        prefix = seq_len - n
        # Query j sits at position prefix + j and sees keys 0..prefix + j.
        mask = torch.ones(n, seq_len, dtype=torch.bool, device=q_nope.device).tril(prefix) if prefix else None
        q = queries[start : start + n].transpose(0, 1)
        k = keys[first_key : first_key + seq_len].transpose(0, 1)
        v = values[first_key : first_key + seq_len].transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=layer.scaling)
        out[start : start + n] = o.transpose(0, 1)
        first_key += seq_len
    return out
