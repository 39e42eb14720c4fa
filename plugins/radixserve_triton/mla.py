"""``triton_mla``: multi-head latent attention with a Triton decode kernel.

Decode absorbs (radixserve/kernels/mla.py): ``W_UK`` goes into the query and
``W_UV`` into the output as two batched matmuls, and the kernel of
``ops/mla.py`` attends over the latent pool directly, each block of entries
read once for a block of heads. Extend is the base class's up-projected form of the
reference (``radixserve.kernels.up_projected_extend``): after the expansion it
is attention over keys and values that exist only for this step, not in the
pool that ``triton``'s extend kernel reads, and its cost is the expansion's
GEMM and the attention's matmuls, which torch already runs on the device's own
libraries. The new entries go into the pool with the base class's store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import (
    KernelQuery,
    MLAAttentionBackend,
    MLALayerSpec,
    latent_pool,
    mla_reasons,
)
from radixserve_triton._env import device_reasons, dtype_reasons, kernel_module
from radixserve_triton.config import DEFAULT_ATTENTION_CONFIG, AttentionKernelConfig

# The kernel holds a whole latent row and rotary row of BLOCK_HEADS heads in registers.
MAX_KV_LORA_RANK = 512
MAX_ROPE_DIM = 128


@dataclass
class TritonMLAMetadata:
    """Per-step values shared by every layer (filled by ``init_forward_metadata``)."""

    mode: ForwardMode
    num_kv_splits: int


class TritonMLAAttention(MLAAttentionBackend):
    """Runs on cuda and rocm; on cpu only under ``TRITON_INTERPRET=1`` (tests),
    where its priority makes ``auto`` pick it over ``torch_mla``."""

    name = "triton_mla"
    priority = 10
    kernel_config: ClassVar[AttentionKernelConfig] = DEFAULT_ATTENTION_CONFIG

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        reasons = device_reasons(query) + dtype_reasons(query) + mla_reasons(query, cls.name)
        if query.mla is not None and query.mla.kv_lora_rank > MAX_KV_LORA_RANK:
            reasons.append(f"kv_lora_rank {query.mla.kv_lora_rank} is above {MAX_KV_LORA_RANK}")
        if query.mla is not None and query.mla.rope_dim > MAX_ROPE_DIM:
            reasons.append(f"rotary dim {query.mla.rope_dim} is above {MAX_ROPE_DIM}")
        return reasons

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        self._kernels = kernel_module(query, "triton_mla attention", "mla")

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = self._metadata(batch)

    def _metadata(self, batch: ForwardBatch) -> TritonMLAMetadata:
        splits = 1
        if batch.mode is ForwardMode.DECODE:
            splits = self._decode_splits(
                batch.batch_size, max(batch.seq_lens_cpu or batch.seq_lens.tolist(), default=0)
            )
        return TritonMLAMetadata(mode=batch.mode, num_kv_splits=splits)

    def _decode_splits(self, batch_size: int, max_seq_len: int) -> int:
        head_blocks = self._kernels.num_head_blocks(self.query.num_heads or 1)
        return self.kernel_config.num_kv_splits(batch_size, head_blocks, max_seq_len)

    # -- graph capture ----------------------------------------------------------------
    # As ``triton``'s: decode reads seq_lens, req_pool_indices and req_to_token on the
    # device (and the absorbing matmuls and the latent store are device work), so the
    # number of KV splits, fixed per captured size for the longest possible context, is
    # the only per-batch choice; a short request leaves some of its splits empty.

    def graph_unsupported_reasons(self, max_bs: int, max_context: int) -> list[str]:
        return []

    def init_graph_state(self, max_bs: int, max_context: int, device: torch.device) -> None:
        self._graph_context = max_context

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        splits = self._decode_splits(batch.batch_size, self._graph_context)
        batch.attn_metadata = TritonMLAMetadata(mode=ForwardMode.DECODE, num_kv_splits=splits)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Nothing to refresh: the captured metadata holds for every batch of its size."""

    def forward_mla_decode(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_b_weight: torch.Tensor,
        layer: MLALayerSpec,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta = batch.attn_metadata
        if not isinstance(meta, TritonMLAMetadata) or meta.mode is not batch.mode:
            meta = batch.attn_metadata = self._metadata(batch)
        w_uk, w_uv = kv_b_weight[:, : layer.qk_nope_head_dim], kv_b_weight[:, layer.qk_nope_head_dim :]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, kv_lora_rank]
        out_latent = self._kernels.mla_decode_attention(
            q_latent,
            q_rope,
            latent_pool(batch).get_latent(layer.layer_id),
            batch.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            layer.scaling,
            num_kv_splits=meta.num_kv_splits,
            config=self.kernel_config,
        )
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v_head_dim]
