"""``triton``: paged attention (extend and decode) and the KV store in Triton."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import AttentionBackend, AttentionLayerSpec, KernelQuery, attention_feature_reasons
from radixserve_triton._env import device_reasons, dtype_reasons, kernel_module
from radixserve_triton.config import DEFAULT_ATTENTION_CONFIG, AttentionKernelConfig

MAX_HEAD_DIM = 256


@dataclass
class TritonAttentionMetadata:
    """Per-step values shared by every layer (filled by ``init_forward_metadata``)."""

    mode: ForwardMode
    max_seq_len: int
    max_extend_len: int
    extend_start: torch.Tensor  # [B] offset of each request's first new token
    num_kv_splits: int


class TritonAttention(AttentionBackend):
    """Triton kernels: flash-decoding with split KV for decode, a causal
    flash-attention over the cached prefix plus the new tokens for extend, and a
    scatter kernel that stores the new K/V into the pool. A layer's sliding
    window and logit cap are compile-time constants of its kernels (one variant
    per distinct value; graphs capture each layer's).

    Runs on cuda and rocm; on cpu only under ``TRITON_INTERPRET=1`` (the
    interpreter, for tests), where its priority makes ``auto`` pick it over
    ``torch_native``: setting that variable is the opt-in.
    """

    name = "triton"
    priority = 10
    # Block sizes and num_warps of every launch; hardware plugins subclass with their own.
    kernel_config: ClassVar[AttentionKernelConfig] = DEFAULT_ATTENTION_CONFIG

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        reasons = (
            device_reasons(query)
            + dtype_reasons(query)
            + attention_feature_reasons(query, cls.name, sliding_window=True, logit_softcap=True)
        )
        if query.head_dim is not None and not 1 <= query.head_dim <= MAX_HEAD_DIM:
            reasons.append(f"head_dim {query.head_dim} is not supported (1..{MAX_HEAD_DIM})")
        if query.num_heads is not None and query.num_kv_heads and query.num_heads % query.num_kv_heads:
            reasons.append(f"num_heads {query.num_heads} is not a multiple of num_kv_heads {query.num_kv_heads}")
        return reasons

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        self._kernels = kernel_module(query, "triton attention", "attention")

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = self._metadata(batch)

    def _metadata(self, batch: ForwardBatch) -> TritonAttentionMetadata:
        seq_lens = batch.seq_lens_cpu or batch.seq_lens.tolist()
        extend_lens = batch.extend_lens_cpu or batch.extend_lens.tolist()
        max_seq = max(seq_lens, default=0)
        extend_start = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
        splits = 1
        if batch.mode is ForwardMode.DECODE:
            num_kv_heads = batch.kv_pool.k_buffers[0].shape[1]
            splits = self._kernels.choose_num_kv_splits(len(seq_lens), num_kv_heads, max_seq, self.kernel_config)
        return TritonAttentionMetadata(
            mode=batch.mode,
            max_seq_len=max_seq,
            max_extend_len=max(extend_lens, default=0),
            extend_start=extend_start,
            num_kv_splits=splits,
        )

    def _meta(self, batch: ForwardBatch) -> TritonAttentionMetadata:
        meta = batch.attn_metadata
        if not isinstance(meta, TritonAttentionMetadata) or meta.mode is not batch.mode:
            meta = batch.attn_metadata = self._metadata(batch)
        return meta

    # -- graph capture ----------------------------------------------------------------
    # Decode reads seq_lens, req_pool_indices and req_to_token from the device, so
    # the only per-batch choice is the number of KV splits: fixed per captured
    # size for the longest possible context (each request then cuts its own keys
    # into that many ranges in the kernel; short ones leave some empty).

    def graph_unsupported_reasons(self, max_bs: int, max_context: int) -> list[str]:
        return []

    def init_graph_state(self, max_bs: int, max_context: int, device: torch.device) -> None:
        self._graph_context = max_context
        self._graph_token_index = torch.arange(max_bs, device=device)  # decode: request i's token is token i

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        bs = batch.batch_size
        num_kv_heads = batch.kv_pool.k_buffers[0].shape[1]
        batch.attn_metadata = TritonAttentionMetadata(
            mode=ForwardMode.DECODE,
            max_seq_len=self._graph_context,
            max_extend_len=1,
            extend_start=self._graph_token_index[:bs],
            num_kv_splits=self._kernels.choose_num_kv_splits(bs, num_kv_heads, self._graph_context, self.kernel_config),
        )

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Nothing to refresh: the captured metadata holds for every batch of its size."""

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> None:
        k_cache, v_cache = batch.kv_pool.get_kv(layer.layer_id)
        self._kernels.store_kv(k, v, k_cache, v_cache, batch.out_cache_loc, self.kernel_config)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta = self._meta(batch)
        k_cache, v_cache = batch.kv_pool.get_kv(layer.layer_id)
        out: torch.Tensor = self._kernels.extend_attention(
            q,
            k_cache,
            v_cache,
            batch.req_to_token,
            batch.req_pool_indices,
            batch.prefix_lens,
            batch.extend_lens,
            meta.extend_start,
            meta.max_extend_len,
            layer.scaling,
            config=self.kernel_config,
            sliding_window=layer.sliding_window,
            logit_softcap=layer.logit_softcap,
        )
        return out

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta = self._meta(batch)
        k_cache, v_cache = batch.kv_pool.get_kv(layer.layer_id)
        splits = meta.num_kv_splits
        if layer.sliding_window is not None:  # the splits cut the window's keys: no more than it fills
            splits = min(splits, -(-layer.sliding_window // self.kernel_config.min_keys_per_split))
        out: torch.Tensor = self._kernels.decode_attention(
            q,
            k_cache,
            v_cache,
            batch.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            layer.scaling,
            num_kv_splits=splits,
            config=self.kernel_config,
            sliding_window=layer.sliding_window,
            logit_softcap=layer.logit_softcap,
        )
        return out
