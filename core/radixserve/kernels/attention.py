"""Attention over the paged KV pool: the interface every attention backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from radixserve.cache.memory_pool import KVLayout
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
    # A query at position p sees only the keys at positions p - sliding_window + 1 .. p
    # (HF's rule; None: all keys up to p). Models interleave windowed and global layers.
    sliding_window: int | None = None
    # Scores become logit_softcap * tanh(scores / logit_softcap) before the softmax
    # (after scaling; Gemma 2). None: no cap.
    logit_softcap: float | None = None


class AttentionBackend(Backend):
    """Computes causal attention for the new tokens of a ForwardBatch.

    ``forward`` first stores the new tokens' K and V into the KV pool at
    ``batch.out_cache_loc`` for ``layer.layer_id``, then attends each new query
    to all ``seq_lens[i]`` tokens of its request (prefix + new, causally), or
    to the last ``layer.sliding_window`` of them, with ``layer.logit_softcap``
    applied to the scaled scores. A backend that lacks either says so in
    ``unsupported_reasons`` when the query sets ``sliding_window`` or
    ``logit_softcap`` (see :func:`attention_feature_reasons`).
    Shapes: q ``[num_tokens, num_heads, head_dim]``, k/v
    ``[num_tokens, num_kv_heads, head_dim]``; returns
    ``[num_tokens, num_heads, head_dim]``.

    Graph capture (decode only, see runtime/execution/graph_runner.py): a backend that can
    run a decode step with shapes fixed by the batch size alone and without
    reading anything on the host answers ``graph_unsupported_reasons`` with no
    reason and implements the three other ``*graph*`` hooks. The other backends
    still serve; graphs are then off.
    """

    # The KV pool layout this backend reads; the runner builds the pool with it
    # (token-major by default, which every backend in the core reads).
    kv_layout: ClassVar[KVLayout] = KVLayout()

    def __init__(self, query: KernelQuery):
        self.query = query

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Called once per step before the layers run; fill ``batch.attn_metadata``."""

    def graph_unsupported_reasons(self, max_bs: int, max_context: int) -> list[str]:
        """Why decode steps of up to ``max_bs`` requests of up to ``max_context``
        tokens cannot be captured with this backend (empty: they can)."""
        return [f"attention backend {self.name!r} has no graph capture hooks"]

    def init_graph_state(self, max_bs: int, max_context: int, device: torch.device) -> None:
        """Allocate the static metadata buffers that every captured batch size
        shares, once, before the first capture. ``max_context`` is the width of
        ``req_to_token``: no request is longer."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support graph capture")

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """``init_forward_metadata`` for the decode batch about to be captured at
        size ``batch.batch_size``. Its tensors are views of the graph runner's
        static buffers and its host lists (``seq_lens_cpu``, ...) are empty: set
        ``batch.attn_metadata`` from static buffers only, so that what the graph
        records stays valid for every batch of this size replayed later."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support graph capture")

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Before each replay of the graph captured for ``batch.batch_size``: the
        static buffers now hold the new batch, then padding rows (``seq_len`` 1,
        request row 0, their K/V written to the reserved KV page 0; their outputs
        are dropped). Refresh the static metadata in place from the device
        tensors, with no host sync; ``batch.seq_lens_cpu`` holds the same
        lengths on the host (padding rows included) for planners that run
        there, and is empty again when the graph replays."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support graph capture")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        if batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, layer, batch)
        return self.forward_extend(q, layer, batch)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> None:
        """Write the new tokens' K/V into the pool at ``batch.out_cache_loc``
        (converted to the pool's dtype); a backend with a store kernel of its own
        overrides this."""
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError


def attention_feature_reasons(
    query: KernelQuery, name: str, *, sliding_window: bool = False, logit_softcap: bool = False, mla: bool = False
) -> list[str]:
    """Why backend ``name``, which supports only the features flagged True,
    cannot serve the attention features that ``query``'s model uses. ``mla``:
    multi-head latent attention, which only an ``MLAAttentionBackend`` serves
    (radixserve/kernels/mla.py)."""
    reasons = []
    if query.mla is not None and not mla:
        reasons.append(f"{name} has no multi-head latent attention (the model keeps a latent KV: {query.mla})")
    if query.sliding_window is not None and not sliding_window:
        reasons.append(f"{name} has no sliding-window attention (the model has windowed layers)")
    if query.logit_softcap is not None and not logit_softcap:
        reasons.append(f"{name} has no attention logit soft-capping (the model caps its scores)")
    return reasons
