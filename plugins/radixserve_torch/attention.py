"""Paged attention in plain PyTorch: the reference every other backend must match."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.forward_batch import ForwardBatch
from radixserve.kernels import AttentionBackend, AttentionLayerSpec, KernelQuery, attention_feature_reasons

# Under graphs, decode reads each request's whole slot table row (it cannot know
# the batch's longest context), so graphs are offered only while the captured
# batch x context stays this small: this backend is the reference, for tests and
# short contexts.
_MAX_GRAPH_KEYS = 1 << 20


@dataclass
class _GraphDecodeMetadata:
    """Static decode metadata of one captured batch size (views of the shared buffers)."""

    slots: torch.Tensor  # [bs, max_context] each request's slot table row
    mask: torch.Tensor  # [bs, max_context] position < seq_len


class TorchNativeAttention(AttentionBackend):
    name = "torch_native"
    priority = 0

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return grouped_heads_reasons(query) + attention_feature_reasons(
            query, cls.name, sliding_window=True, logit_softcap=True
        )

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        out = torch.empty_like(q)
        for i, start in enumerate(batch.extend_start_loc):
            n, seq_len = batch.extend_lens_cpu[i], batch.seq_lens_cpu[i]
            slots = batch.req_to_token[batch.req_pool_indices[i], :seq_len]
            k = k_buf.index_select(0, slots).to(q.dtype)
            v = v_buf.index_select(0, slots).to(q.dtype)
            # Query j sits at position prefix+j and sees keys 0..prefix+j (the last
            # sliding_window of them in a windowed layer).
            prefix = seq_len - n
            mask = None
            if prefix or layer.sliding_window is not None:
                mask = torch.ones(n, seq_len, dtype=torch.bool, device=q.device).tril(prefix)
                if layer.sliding_window is not None:
                    mask.triu_(prefix - layer.sliding_window + 1)
            out[start : start + n] = _sdpa(q[start : start + n], k, v, mask, layer)
        return out

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        meta = batch.attn_metadata
        if isinstance(meta, _GraphDecodeMetadata):  # captured: whole rows, shapes fixed by the batch size
            slots, mask = meta.slots, meta.mask
        else:
            max_len = max(batch.seq_lens_cpu)
            slots = batch.req_to_token[batch.req_pool_indices, :max_len]  # [B, S]; padding points anywhere
            positions = torch.arange(max_len, device=q.device)
            mask = positions[None, :] < batch.seq_lens[:, None]  # [B, S]
        if layer.sliding_window is not None:  # the request's last token sees its last sliding_window keys
            first = batch.seq_lens[:, None] - layer.sliding_window
            mask = mask & (torch.arange(mask.shape[1], device=q.device)[None, :] >= first)
        # index_select on the flat slot list is much faster than 2-D indexing.
        shape = (*slots.shape, *k_buf.shape[1:])  # [B, S, KVH, D]
        k = k_buf.index_select(0, slots.flatten()).view(shape).to(q.dtype)
        v = v_buf.index_select(0, slots.flatten()).view(shape).to(q.dtype)
        return _sdpa_batched(q, k, v, mask, layer)

    # -- graph capture -------------------------------------------------------------

    def graph_unsupported_reasons(self, max_bs: int, max_context: int) -> list[str]:
        if max_bs * max_context > _MAX_GRAPH_KEYS:
            return [
                f"torch_native reads every request's whole slot table row under graphs, and "
                f"{max_bs} requests x {max_context} tokens is above {_MAX_GRAPH_KEYS} "
                f"(lower --graph-max-bs or --context-length)"
            ]
        return []

    def init_graph_state(self, max_bs: int, max_context: int, device: torch.device) -> None:
        self._graph_slots = torch.zeros((max_bs, max_context), dtype=torch.int64, device=device)
        self._graph_mask = torch.zeros((max_bs, max_context), dtype=torch.bool, device=device)
        self._graph_positions = torch.arange(max_context, device=device)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        bs = batch.batch_size
        batch.attn_metadata = _GraphDecodeMetadata(self._graph_slots[:bs], self._graph_mask[:bs])
        self.init_forward_metadata_replay(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        meta: _GraphDecodeMetadata = batch.attn_metadata
        torch.index_select(batch.req_to_token, 0, batch.req_pool_indices, out=meta.slots)
        torch.lt(self._graph_positions[None, :], batch.seq_lens[:, None], out=meta.mask)


def grouped_heads_reasons(query: KernelQuery) -> list[str]:
    """Why a query's heads cannot be grouped over its KV heads (empty: they can)."""
    if query.num_heads is not None and query.num_kv_heads and query.num_heads % query.num_kv_heads:
        return [f"num_heads {query.num_heads} is not a multiple of num_kv_heads {query.num_kv_heads}"]
    return []


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, layer: AttentionLayerSpec
) -> torch.Tensor:
    """q [n, H, D], k/v [S, KVH, D], mask [n, S] (None: plain causal) -> [n, H, D]."""
    o = _attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, layer)
    return o.transpose(0, 1)


def _sdpa_batched(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, layer: AttentionLayerSpec
) -> torch.Tensor:
    """q [B, H, D], k/v [B, S, KVH, D], mask [B, S] -> [B, H, D]."""
    o = _attend(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], layer)
    return o.squeeze(2)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, layer: AttentionLayerSpec
) -> torch.Tensor:
    """q [..., H, n, D], k/v [..., KVH, S, D], boolean mask broadcastable to
    [..., H, n, S] (None: causal, n == S) -> [..., H, n, D]. With a logit cap,
    scores and softmax are computed in float32 (SDPA has no cap)."""
    gqa = layer.num_heads != layer.num_kv_heads
    cap = layer.logit_softcap
    if cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=layer.scaling, enable_gqa=gqa
        )
    if gqa:
        group = layer.num_heads // layer.num_kv_heads
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.float().transpose(-1, -2)) * layer.scaling
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)
