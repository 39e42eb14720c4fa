"""Paged attention for ragged batches in a few large torch calls per layer.

``torch_native`` loops over requests in extend and runs one masked SDPA over
KV gathered as ``[B, S, KVH, D]`` in decode. Both are slow on CPU: the masked
bfloat16 SDPA with one query per request is a poor fit for the CPU kernels, it
reads K/V through strided (token-major) views, and every layer allocates (and
page-faults) fresh gather buffers of tens of MB.

This backend plans each step once, in ``init_forward_metadata``:

- requests are sorted by work (decode: context length; extend: new x context
  tokens) and cut into a few **buckets**, so that padding each bucket to its
  largest request wastes little;
- per bucket it precomputes the flat gather index that pulls the K/V of all the
  bucket's tokens out of the paged pool straight into a head-major
  ``[b, KVH, S, D]`` layout (one ``index_select`` per layer for K and one for V,
  over all buckets at once, into a workspace reused by every layer and step),
  and the masks.

Per layer, decode is a grouped ``bmm`` (query heads of one KV head stacked as
rows: ``[b*KVH, G, D] @ [b*KVH, D, S]``), a masked softmax computed in float32,
and a second ``bmm``; extend is one ``scaled_dot_product_attention`` per bucket
over the padded queries with a block-diagonal causal mask that accounts for
cached prefixes (or plain ``is_causal`` when a bucket holds only fresh
prompts). Measurements and the rejected alternatives: docs/plugins.md and
benchmarks/bench_cpu_attention.py.

Sliding windows and logit soft-capping are per layer: a windowed layer uses
masks that also hide the keys before each query's window, made on its first
use in a step and shared by every layer with that window (the gather still
reads all keys); a capped layer computes its scores, caps them and takes the
softmax in float32, from float32 copies of q and K (extend: ``matmul``s instead
of SDPA, which has no cap).
Layers with neither run exactly the code above.

Pure torch, so it runs on any torch device; ``auto`` picks it wherever it has
the highest priority among usable backends (on ``cpu`` by default; the Triton
backends outrank it where they are usable).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import AttentionBackend, AttentionLayerSpec, KernelQuery, attention_feature_reasons
from radixserve_torch.attention import grouped_heads_reasons

# A new bucket starts when a request's work is less than this fraction of the
# work of the bucket's first (largest) request ...
_BUCKET_FILL = 0.7
# ... but only once the current bucket holds this much padded work (decode: key
# tokens; extend: query x key pairs): a smaller bucket saves less than its few
# extra calls per layer cost.
_MIN_DECODE_WORK, _MIN_EXTEND_WORK = 4096, 65536
_MAX_BUCKETS = 8


@dataclass
class _Bucket:
    """Requests ``order[start:end]`` padded to ``seq_len`` keys (and ``num_queries`` queries in extend)."""

    start: int
    end: int
    seq_len: int
    num_queries: int
    kv_offset: int  # first row of this bucket in the gathered [rows, D] workspace
    mask: torch.Tensor | None  # decode: additive [b, 1, S]; extend: bool [b, 1, N, S], None: is_causal
    # Each query's position ([b, 1] in decode, [b, N] in extend): what a window's mask starts from.
    query_pos: torch.Tensor | None = None
    query_index: torch.Tensor | None = None  # extend: [b*N] token of each padded query row
    valid_rows: torch.Tensor | None = None  # extend: padded rows that are real tokens
    token_index: torch.Tensor | None = None  # extend: the token each valid row is
    real: torch.Tensor | None = None  # extend: [b, N] which padded query rows are real tokens
    # Masks of this step by sliding window (None: full attention), made on first use:
    # decode additive [b, 1, S] in the compute dtype, extend bool [b, 1, N, S] (never None).
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.end - self.start

    def window_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """The mask of a layer with ``window`` (None: full attention, explicit even for
        fresh prompts), made once per step."""
        mask = self.masks.get(window)
        if mask is None:
            query_pos = self.query_pos
            assert query_pos is not None  # set by the step's plan
            keys = torch.arange(self.seq_len, device=query_pos.device)
            if self.real is None:  # decode: the query is the request's last key
                visible = keys[None, :] <= query_pos
                if window is not None:
                    visible &= keys[None, :] > query_pos - window
                mask = torch.zeros(visible.shape, dtype=dtype, device=keys.device).masked_fill_(~visible, float("-inf"))
                mask = mask[:, None, :]
            else:
                pos = query_pos[:, :, None]
                visible = keys[None, None, :] <= pos
                if window is not None:
                    visible &= keys[None, None, :] > pos - window
                visible &= self.real[:, :, None]
                visible[:, :, 0] |= ~self.real  # padded query rows see one key (their output is dropped)
                mask = visible[:, None]
            self.masks[window] = mask
        return mask


@dataclass
class VarlenMetadata:
    """The per-step plan every layer reuses."""

    kv_index: torch.Tensor  # [rows] rows of the pool viewed as [slots * KVH, D], bucket after bucket
    buckets: list[_Bucket]
    order: torch.Tensor | None  # decode: requests in bucket order (None: already in order)


class TorchVarlenAttention(AttentionBackend):
    name = "torch_varlen"
    priority = 5  # above torch_native (0), below the Triton kernels (10)

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        self._k_work: torch.Tensor | None = None
        self._v_work: torch.Tensor | None = None

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return grouped_heads_reasons(query) + attention_feature_reasons(
            query, cls.name, sliding_window=True, logit_softcap=True
        )

    # -- per step ---------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        kv_heads = batch.kv_pool.get_kv(0)[0].shape[1]
        decode = batch.mode is ForwardMode.DECODE
        seq, ext = batch.seq_lens_cpu, batch.extend_lens_cpu
        # Longest first; decode work per request ~ seq_len, extend work ~ new x seq_len.
        work = seq if decode else [n * s for n, s in zip(ext, seq, strict=True)]
        order = sorted(range(len(seq)), key=lambda i: -work[i])
        device = batch.req_to_token.device
        order_t = torch.tensor(order, dtype=torch.int64, device=device)
        rows = batch.req_to_token.index_select(0, batch.req_pool_indices.index_select(0, order_t))
        seq_sorted = batch.seq_lens.index_select(0, order_t)
        starts = [] if decode else batch.extend_start_loc  # decode: unused

        buckets, indices, offset = [], [], 0
        for start, end in _split(order, work, _MIN_DECODE_WORK if decode else _MIN_EXTEND_WORK):
            s_max = seq[order[start]] if decode else max(seq[i] for i in order[start:end])
            n_max = 1 if decode else max(ext[i] for i in order[start:end])
            positions = torch.arange(s_max, device=device)
            visible = positions[None, :] < seq_sorted[start:end, None]  # [b, S]
            slots = torch.where(visible, rows[start:end, :s_max], 0)  # padding reads slot 0 (reserved page)
            heads = torch.arange(kv_heads, device=device)
            indices.append((slots[:, None, :] * kv_heads + heads[None, :, None]).flatten())
            bucket = _Bucket(start, end, s_max, n_max, offset, None)
            offset += (end - start) * kv_heads * s_max
            if decode:  # in the compute dtype: adding 0 or -inf is exact in any float dtype
                bucket.mask = torch.zeros(visible.shape, dtype=self.query.dtype, device=device).masked_fill_(
                    ~visible, float("-inf")
                )[:, None, :]
                bucket.masks[None] = bucket.mask
                bucket.query_pos = seq_sorted[start:end, None] - 1
            else:
                self._plan_extend(bucket, [order[i] for i in range(start, end)], starts, batch, device)
            buckets.append(bucket)
        reorder = decode and order != list(range(len(order)))
        batch.attn_metadata = VarlenMetadata(torch.cat(indices), buckets, order_t if reorder else None)

    @staticmethod
    def _plan_extend(
        bucket: _Bucket, reqs: list[int], starts: list[int], batch: ForwardBatch, device: torch.device
    ) -> None:
        n_max, s_max = bucket.num_queries, bucket.seq_len
        new = torch.tensor([batch.extend_lens_cpu[i] for i in reqs], device=device)
        prefix = torch.tensor([batch.prefix_lens_cpu[i] for i in reqs], device=device)
        first = torch.tensor([starts[i] for i in reqs], device=device)
        j = torch.arange(n_max, device=device)
        real = j[None, :] < new[:, None]  # [b, N]
        tokens = first[:, None] + j[None, :]
        bucket.query_index = torch.where(real, tokens, 0).flatten()
        bucket.valid_rows = real.flatten().nonzero().flatten()
        bucket.token_index = tokens.flatten().index_select(0, bucket.valid_rows)
        bucket.query_pos, bucket.real = prefix[:, None] + j[None, :], real
        if not any(batch.prefix_lens_cpu[i] for i in reqs):
            # Fresh prompts only: queries and keys both start at position 0, so the
            # top-left causal mask of ``is_causal`` (which skips masked blocks) is
            # exact for every real query; a padded key j >= n is seen only by padded
            # query rows i >= j, whose output is discarded.
            bucket.mask = None
            return
        # Query j of a request sits at position prefix + j and sees keys 0..prefix + j.
        keys = torch.arange(s_max, device=device)
        mask = keys[None, None, :] <= (prefix[:, None, None] + j[None, :, None])
        mask &= real[:, :, None]
        mask[:, :, 0] |= ~real  # padded query rows see one key, so their (discarded) softmax stays finite
        bucket.mask = bucket.masks[None] = mask[:, None]

    # -- per layer ----------------------------------------------------------------

    def _gather(
        self, layer: AttentionLayerSpec, batch: ForwardBatch, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All buckets' K and V, head-major, into the reused workspace: two index_selects."""
        meta: VarlenMetadata = batch.attn_metadata
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        rows, d = meta.kv_index.numel(), k_buf.shape[-1]
        k_work, v_work = self._k_work, self._v_work  # made together: both None or neither
        if (
            k_work is None
            or v_work is None
            or k_work.numel() < rows * d
            or k_work.dtype != k_buf.dtype
            or k_work.device != k_buf.device
        ):
            capacity = rows * d * 5 // 4  # headroom, so slowly growing batches rarely reallocate
            k_work = self._k_work = torch.empty(capacity, dtype=k_buf.dtype, device=k_buf.device)
            v_work = self._v_work = torch.empty(capacity, dtype=k_buf.dtype, device=k_buf.device)
        k = k_work[: rows * d].view(rows, d)
        v = v_work[: rows * d].view(rows, d)
        torch.index_select(k_buf.view(-1, d), 0, meta.kv_index, out=k)
        torch.index_select(v_buf.view(-1, d), 0, meta.kv_index, out=v)
        return k.to(dtype), v.to(dtype)  # no copy when the pool has the compute dtype

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta: VarlenMetadata = batch.attn_metadata
        k, v = self._gather(layer, batch, q.dtype)
        kvh, d = layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // kvh
        window, cap = layer.sliding_window, layer.logit_softcap
        dtype = q.dtype
        # Scaling q first keeps the low-precision scores in range; a capped layer's
        # scores are float32 (large scores are what the cap is for).
        q = (q * layer.scaling).contiguous() if cap is None else q.float() * layer.scaling
        if meta.order is not None:
            q = q.index_select(0, meta.order)
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        for b in meta.buckets:
            n, s = b.size * kvh, b.seq_len
            keys = k[b.kv_offset : b.kv_offset + n * s].view(n, s, d)
            values = v[b.kv_offset : b.kv_offset + n * s].view(n, s, d)
            if cap is not None:
                keys = keys.float()
            scores = torch.bmm(q[b.start : b.end].view(n, group, d), keys.transpose(1, 2))  # [b*KVH, G, S]
            mask = b.mask if window is None else b.window_mask(window, dtype)
            assert mask is not None  # a decode bucket always has one
            if cap is not None:
                scores = torch.tanh(scores.div_(cap)).mul_(cap)
            scores = scores.view(b.size, kvh * group, s).add_(mask)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype).view(n, group, s)
            torch.bmm(probs, values, out=out[b.start : b.end].view(n, group, d))
        if meta.order is not None:
            out = torch.empty_like(out).index_copy_(0, meta.order, out)
        return out

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta: VarlenMetadata = batch.attn_metadata
        k, v = self._gather(layer, batch, q.dtype)
        h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        window, cap = layer.sliding_window, layer.logit_softcap
        out = torch.empty_like(q)
        for b in meta.buckets:
            # set by the extend plan:
            assert b.query_index is not None and b.valid_rows is not None and b.token_index is not None
            n, s = b.size * kvh, b.seq_len
            keys = k[b.kv_offset : b.kv_offset + n * s].view(b.size, kvh, s, d)
            values = v[b.kv_offset : b.kv_offset + n * s].view(b.size, kvh, s, d)
            queries = q.index_select(0, b.query_index).view(b.size, b.num_queries, h, d).transpose(1, 2)
            if cap is not None:
                o = _capped_attention(queries, keys, values, b.window_mask(window, q.dtype), layer.scaling, cap)
            else:
                mask = b.mask if window is None else b.window_mask(window, q.dtype)
                o = F.scaled_dot_product_attention(
                    queries,
                    keys,
                    values,
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=layer.scaling,
                    enable_gqa=h != kvh,
                )
            o = o.transpose(1, 2).reshape(b.size * b.num_queries, h, d)
            out.index_copy_(0, b.token_index, o.index_select(0, b.valid_rows))
        return out


def _capped_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float, cap: float
) -> torch.Tensor:
    """SDPA with a layer's ``scaling`` and logit ``cap``: queries [b, H, N, D], keys/values
    [b, KVH, S, D], mask bool [b, 1, N, S] -> [b, H, N, D]. The query heads of a
    KV head are stacked as rows of one ``matmul``; scores, cap and softmax in
    float32, the probabilities rounded to the values' dtype for P.V."""
    b, h, n, d = queries.shape
    kvh, s = keys.shape[1], keys.shape[2]
    group = h // kvh
    scores = torch.matmul(queries.reshape(b, kvh, group * n, d).float(), keys.float().transpose(2, 3))
    scores = torch.tanh(scores.mul_(scaling / cap)).mul_(cap)
    scores = scores.view(b, kvh, group, n, s).masked_fill_(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(queries.dtype).view(b, kvh, group * n, s)
    return torch.matmul(probs, values).view(b, h, n, d)


def _split(order: list[int], work: list[int], min_work: int) -> list[tuple[int, int]]:
    """Cut ``order`` (largest work first) into at most ``_MAX_BUCKETS`` runs.

    A run closes when the next request's work falls below ``_BUCKET_FILL`` of
    the run's first (largest) one and the run already holds ``min_work`` of
    padded work; the last run takes whatever remains."""
    spans: list[tuple[int, int]] = []
    start = 0
    for pos in range(1, len(order)):
        if len(spans) == _MAX_BUCKETS - 1:
            break
        head = work[order[start]]
        padded = (pos - start) * head
        if work[order[pos]] < _BUCKET_FILL * head and padded >= min_work:
            spans.append((start, pos))
            start = pos
    spans.append((start, len(order)))
    return spans
