"""``npu_fused``: paged attention through ``torch_npu.npu_fused_infer_attention_score``.

How radixserve's batch maps onto the operator (torch_npu's documentation of the
operator, PageAttention scenario):

- query in layout ``"BNSD"``: decode ``[B, N, 1, D]``; extend ``[B, N, S, D]`` with
  each request's new tokens padded on the right to the longest, ``S``.
- key/value: the layer's KV pool pages. The backend asks for a head-major pool
  (``KVLayout(head_major=True)``, ``(blocknum, KV_N, blocksize, D)``, which the
  documentation recommends for speed and which has no ``KV_N * D <= 65535``
  limit); a token-major pool is passed as ``(blocknum, blocksize, H)``, the
  other accepted form. Page 0, the pool's reserved page, is a real block too,
  so block ids are simply page ids (``slot // page_size``).
- ``block_table``: int32 ``[B, ceil(max(seq_lens) / page_size)]``, row ``i`` the
  pages of request ``i`` in order; entries past its last page are 0.
- ``actual_seq_lengths_kv``: ``seq_lens`` (prefix + new) as a host list;
  ``actual_seq_lengths``: ``extend_lens`` as a host list (extend only).
- causal with a cached prefix: ``sparse_mode=3`` (right-down causal: query ``j``
  of ``n`` sees keys ``0 .. seq_len - n + j``) with the operator's 2048 x 2048
  upper-triangular mask. A step whose queries are one per request takes the
  single-query branch (no mask).
- ``scale`` = ``layer.scaling``, ``num_heads``, ``num_key_value_heads``, ``block_size``.

What the operator does not take, and where it goes:

- float32 (the operator takes float16 and bfloat16), a KV dtype other than the
  model's, head dims that are not a multiple of 16 or above 512, more than 256
  query heads or more than 64 query heads per KV head, and page sizes that are
  not a multiple of 16: ``unsupported_reasons`` rejects the model, and selection
  takes another backend (logged).
- extend steps with several new tokens per request when the page size is not
  128, 256, 384 or 512 (the documented block sizes for multi-token queries):
  that step runs the torch reference over the same pages (``route`` in the
  metadata says which), a per-shape route decided once per step. Decode always
  takes the operator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.cache.memory_pool import KVLayout, KVPool
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import AttentionBackend, AttentionLayerSpec, KernelQuery, attention_feature_reasons
from radixserve_npu import ops

FUSED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 512
MAX_HEADS = 256
MAX_GROUP = 64  # query heads per KV head
DECODE_BLOCK_MULTIPLE = 16  # one query per request: block_size 16-aligned (float16/bfloat16)
PREFILL_BLOCK_SIZES = (128, 256, 384, 512)  # several queries per request
CAUSAL_MASK_SIZE = 2048  # sparse_mode 3 takes this fixed-size mask
RIGHT_DOWN_CAUSAL = 3  # sparse_mode


@dataclass
class NpuAttentionMetadata:
    """What the operator needs for one step, built once and shared by every layer."""

    route: str  # "fused" or "reference" (extend steps at a page size the prefill operator does not take)
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: list[int]  # actual_seq_lengths_kv
    extend_lens: list[int]  # actual_seq_lengths
    max_extend: int  # S of the padded query
    pad_index: torch.Tensor  # [T] int64: row of each new token in the padded [B * S] query


def build_block_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: list[int],
    page_size: int,
) -> torch.Tensor:
    """int32 ``[B, ceil(max(seq_lens) / page_size)]``: the page ids of each request in
    order, 0 past its last page. A request's ``j``-th page is the page of its slot at
    position ``j * page_size`` (the allocator keeps a page's slots together)."""
    first_slots = req_to_token[req_pool_indices, 0 : max(seq_lens_cpu) : page_size]
    num_blocks = (seq_lens + page_size - 1) // page_size
    used = torch.arange(first_slots.shape[1], device=first_slots.device)[None, :] < num_blocks[:, None]
    return torch.where(used, first_slots // page_size, 0).to(torch.int32)


def build_padding_index(extend_lens_cpu: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """``(index, S)``: new token ``j`` of request ``i`` goes to row ``i * S + j`` of the
    right-padded query, ``S = max(extend_lens)``."""
    longest = max(extend_lens_cpu)
    lens = torch.tensor(extend_lens_cpu, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens  # offset of each request's first new token
    shift = torch.arange(len(extend_lens_cpu), dtype=torch.int64) * longest - starts
    index = torch.arange(int(lens.sum()), dtype=torch.int64) + torch.repeat_interleave(shift, lens)
    return index.to(device), longest


def choose_route(mode: ForwardMode, max_extend: int, page_size: int) -> str:
    """The operator covers one query per request at any accepted page size, and
    several only at the prefill block sizes."""
    if mode is ForwardMode.DECODE or max_extend == 1 or page_size in PREFILL_BLOCK_SIZES:
        return "fused"
    return "reference"


def build_metadata(batch: ForwardBatch) -> NpuAttentionMetadata:
    ps = batch.kv_pool.page_size
    device = batch.req_to_token.device
    pad_index, longest = build_padding_index(batch.extend_lens_cpu, device)
    return NpuAttentionMetadata(
        route=choose_route(batch.mode, longest, ps),
        block_table=build_block_table(
            batch.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_cpu, ps
        ),
        seq_lens=list(batch.seq_lens_cpu),
        extend_lens=list(batch.extend_lens_cpu),
        max_extend=longest,
        pad_index=pad_index,
    )


def kv_cache_args(pool: KVPool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's pages in a form the operator takes: head-major pools as
    ``(blocknum, KV_N, blocksize, D)``, token-major as ``(blocknum, blocksize, H)``."""
    k, v = pool.get_kv_pages(layer_id)
    if pool.layout.head_major:
        return k, v
    return k.flatten(2), v.flatten(2)


class NpuFusedAttention(AttentionBackend):
    name = "npu_fused"
    priority = 20
    kv_layout = KVLayout(head_major=True)
    devices: tuple[str, ...] = ("npu",)

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        reasons = attention_feature_reasons(query, cls.name)
        if query.device not in cls.devices:
            reasons.append(f"runs on the npu platform only, not {query.device}")
        if query.dtype not in FUSED_DTYPES:
            reasons.append(f"dtype {query.dtype}: torch_npu's fused attention takes float16 and bfloat16")
        if query.kv_dtype is not None and query.kv_dtype != query.dtype:
            reasons.append(f"KV dtype {query.kv_dtype} differs from the model dtype {query.dtype}")
        d, h, kvh = query.head_dim, query.num_heads, query.num_kv_heads
        if d is not None and (d % 16 or d > MAX_HEAD_DIM):
            reasons.append(f"head_dim {d}: the operator takes multiples of 16 up to {MAX_HEAD_DIM}")
        if h is not None and h > MAX_HEADS:
            reasons.append(f"{h} query heads: the operator takes at most {MAX_HEADS}")
        if h is not None and kvh:
            if h % kvh:
                reasons.append(f"num_heads {h} is not a multiple of num_kv_heads {kvh}")
            elif h // kvh > MAX_GROUP:
                reasons.append(f"{h // kvh} query heads per KV head: the operator takes at most {MAX_GROUP}")
        if query.page_size % DECODE_BLOCK_MULTIPLE:
            reasons.append(
                f"page size {query.page_size} is not a multiple of {DECODE_BLOCK_MULTIPLE}, the paged "
                "operator's block size (use --page-size 128)"
            )
        return reasons

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        self._causal_mask: torch.Tensor | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = build_metadata(batch)

    def _metadata(self, batch: ForwardBatch) -> NpuAttentionMetadata:
        if not isinstance(batch.attn_metadata, NpuAttentionMetadata):
            self.init_forward_metadata(batch)
        meta: NpuAttentionMetadata = batch.attn_metadata
        return meta

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta = self._metadata(batch)
        bs = batch.batch_size
        out = self._fused(q.reshape(bs, layer.num_heads, 1, layer.head_dim).contiguous(), layer, batch, meta)
        return out.reshape(bs, layer.num_heads, layer.head_dim)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta = self._metadata(batch)
        if meta.route == "reference":
            return reference_extend(q, layer, batch)
        bs, longest, h, d = batch.batch_size, meta.max_extend, layer.num_heads, layer.head_dim
        padded = q.new_zeros(bs * longest, h, d).index_copy_(0, meta.pad_index, q)
        q_bnsd = padded.view(bs, longest, h, d).transpose(1, 2).contiguous()
        out = self._fused(q_bnsd, layer, batch, meta)  # [B, N, S, D]
        return out.transpose(1, 2).reshape(bs * longest, h, d).index_select(0, meta.pad_index)

    def _fused(
        self, q_bnsd: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch, meta: NpuAttentionMetadata
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache_args(batch.kv_pool, layer.layer_id)
        causal = {}
        if q_bnsd.shape[2] > 1:
            causal = dict(
                actual_seq_lengths=meta.extend_lens, sparse_mode=RIGHT_DOWN_CAUSAL, atten_mask=self._mask(q_bnsd.device)
            )
        out: torch.Tensor
        out, _ = ops.op("npu_fused_infer_attention_score")(
            q_bnsd,
            k_cache,
            v_cache,
            block_table=meta.block_table,
            block_size=batch.kv_pool.page_size,
            actual_seq_lengths_kv=meta.seq_lens,
            num_heads=layer.num_heads,
            num_key_value_heads=layer.num_kv_heads,
            input_layout="BNSD",
            scale=layer.scaling,
            **causal,
        )
        return out

    def _mask(self, device: torch.device) -> torch.Tensor:
        """The 2048 x 2048 mask sparse_mode 3 requires: True above the diagonal (masked)."""
        if self._causal_mask is None or self._causal_mask.device != device:
            ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device)
            self._causal_mask = torch.triu(ones, diagonal=1)
        return self._causal_mask


def gather_tokens(pages: torch.Tensor, slots: torch.Tensor, pool: KVPool) -> torch.Tensor:
    """``[len(slots), kv_heads, head_dim]`` from a layer's pages (either layout)."""
    page, offset = slots // pool.page_size, slots % pool.page_size
    return pages[page, :, offset] if pool.layout.head_major else pages[page, offset]


def reference_extend(q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
    """The torch reference semantics (causal over prefix + new tokens), one request
    at a time, reading the pool's pages in either layout."""
    pool = batch.kv_pool
    k_pages, v_pages = pool.get_kv_pages(layer.layer_id)
    out = torch.empty_like(q)
    for i, start in enumerate(batch.extend_start_loc):
        n, seq_len = batch.extend_lens_cpu[i], batch.seq_lens_cpu[i]
        slots = batch.req_to_token[batch.req_pool_indices[i], :seq_len]
        k = gather_tokens(k_pages, slots, pool).to(q.dtype).transpose(0, 1)
        v = gather_tokens(v_pages, slots, pool).to(q.dtype).transpose(0, 1)
        mask = torch.ones(n, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - n)
        o = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1),
            k,
            v,
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        out[start : start + n] = o.transpose(0, 1)
    return out
