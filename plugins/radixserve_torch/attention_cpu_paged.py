"""Attention on the CPU that reads K/V in place from the paged pool.

``torch_varlen`` gathers every request's K/V out of the pool into a workspace
each layer and reads it again: at W1's decode shape the gather costs about as
much as the attention, and its extend runs torch's SDPA, whose CPU kernel
spends most of its time in the softmax. This backend runs both modes in small
C++ kernels (csrc/: cpu_paged_decode.cpp, cpu_paged_extend.cpp) that walk
``req_to_token`` and read each key's pool row once, with an online softmax in
float32 (flash-attention style):

- decode: one work item per request (or per slice of a long context when the
  batch is too small to occupy every thread), all heads of a KV group per key;
  requests that share a cached prefix (the same leading slots) attend to it
  together in extend tiles, and the rest of their keys here (cascade);
- extend: tiles of 16 (query, head) rows of one request and KV head, with the
  queries transposed so that both products and the softmax run as vectors
  across the tile's rows; causal masking only on the diagonal blocks, cached
  prefixes read from the pool like the new keys.

Every kernel takes the layer's sliding window and logit cap (``0``: none). A
windowed decode starts each request's keys at its window's first key (the
pages before it are never read) and never takes the cascade path (the shared
prefix is mostly outside the window); a windowed extend starts each tile at
its first row's window and masks below the windows; the cap is applied to each
block of scores before its softmax, in every path.

The pool may hold the compute dtype, or bfloat16/float16 under a float32 model.

The kernels are built on the first construction of the backend in a process
(radixserve_torch/cpu_kernels.py: compiled once per machine, then loaded from
torch's extension cache); ``unsupported_reasons`` names a missing compiler or
ninja, or an earlier build failure, so ``auto`` picks ``torch_varlen`` on a
machine that cannot build them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import AttentionBackend, AttentionLayerSpec, KernelQuery, attention_feature_reasons
from radixserve_torch import cpu_kernels
from radixserve_torch.attention import grouped_heads_reasons

# A pool in another dtype than the compute dtype: only low precision under float32.
_KV_DTYPES = {torch.float32: (torch.bfloat16, torch.float16)}


@dataclass(frozen=True)
class CpuPagedKernels:
    """The compiled ops (argument order as csrc/cpu_paged_ops.cpp documents them)."""

    # window: the layer's sliding window (0: none); cap: its logit cap (0.0: none).
    store_kv: Callable[..., None]  # (k, v, loc, k_buf, v_buf)
    decode: Callable[..., None]  # (q, k_buf, v_buf, req_to_token, rows, lens, scaling, window, cap, out)
    decode_with_lse: Callable[..., None]  # (..., scaling, window, cap, out, lse)
    extend: Callable[..., None]  # (q, k_buf, v_buf, req_to_token, rows, q_starts, kv_lens, scaling, window, cap, out)
    cascade: Callable[..., None]  # (q, k_buf, v_buf, req_to_token, rows, group_starts, shared_lens,
    #                                suffix_out, suffix_lse, scaling, cap, out)


def load_kernel() -> CpuPagedKernels:
    """The ``torch.ops.radixserve_cpu_paged`` ops (building the CPU kernels on first use)."""
    cpu_kernels.load()
    ops = torch.ops.radixserve_cpu_paged
    return CpuPagedKernels(
        store_kv=ops.store_kv.default,
        decode=ops.paged_attention,
        decode_with_lse=ops.paged_attention_with_lse,
        extend=ops.extend_attention,
        cascade=ops.cascade_decode_attention,
    )


# A decode group shares a prefix through the cascade kernel only when it is this
# long (keys) and has at least two members with this many (request, head) rows
# for each KV head in all: shorter or narrower groups gain less than the extra
# pass costs.
MIN_SHARED_PREFIX = 64
MIN_GROUP_ROWS = 8


@dataclass
class CascadePlan:
    """Decode requests that share a cached prefix (the same leading pool slots), in
    groups, and the others; positions index the batch."""

    grouped: torch.Tensor  # [M] batch positions of the grouped requests, group after group
    grouped_rows: torch.Tensor  # [M] their rows in req_to_token
    group_starts: torch.Tensor  # [G + 1]: group g is grouped[group_starts[g]:group_starts[g + 1]]
    shared_lens: torch.Tensor  # [G] keys every member of the group shares
    suffix_table: torch.Tensor  # [M, W] each grouped request's slots after its group's prefix
    suffix_rows: torch.Tensor  # [M] 0..M-1: request m's row in suffix_table
    suffix_lens: torch.Tensor  # [M] how many
    solo: torch.Tensor  # [S] batch positions of the other requests
    solo_rows: torch.Tensor  # [S] their rows in req_to_token
    solo_lens: torch.Tensor  # [S] their key counts


@dataclass
class PagedMetadata:
    """The batch's own tensors, contiguous once per step."""

    rows: torch.Tensor  # [B] int64: each request's row in req_to_token
    kv_lens: torch.Tensor  # [B] int64: its keys after this step (cached + new)
    q_starts: torch.Tensor | None = (
        None  # extend: [B + 1] int64, request b's queries are rows q_starts[b]:q_starts[b+1]
    )
    cascade: CascadePlan | None = None  # decode: shared-prefix groups, when there are any


def plan_cascade(
    req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: list[int], group_size: int
) -> CascadePlan | None:
    """Group decode requests by their first pool slot (the radix cache hands
    requests with a common cached prefix the very same slots), and measure each
    group's common prefix: the leading slots all members' rows agree on, short of
    each member's last key. Groups below MIN_SHARED_PREFIX keys, of one request, or
    below MIN_GROUP_ROWS rows are left to the plain decode kernel."""
    candidates = [i for i, n in enumerate(seq_lens) if n > MIN_SHARED_PREFIX]
    if len(candidates) < 2 or len(candidates) * group_size < MIN_GROUP_ROWS:
        return None
    device = rows.device
    index = torch.tensor(candidates, dtype=torch.int64, device=device)
    table_rows = rows.index_select(0, index)
    by_first: dict[int, list[int]] = {}
    for k, first in enumerate(req_to_token[table_rows, 0].tolist()):
        by_first.setdefault(first, []).append(k)
    grouped, starts, shared, member_shared = [], [0], [], []
    for members in by_first.values():  # positions in `candidates`
        if len(members) < 2 or len(members) * group_size < MIN_GROUP_ROWS:
            continue
        width = min(seq_lens[candidates[k]] for k in members) - 1
        table = req_to_token[table_rows[members], :width]
        differs = (table != table[0]).any(0).nonzero()
        common = int(differs[0]) if differs.numel() else width
        if common >= MIN_SHARED_PREFIX:
            grouped += [candidates[k] for k in members]
            starts.append(len(grouped))
            shared.append(common)
            member_shared += [common] * len(members)
    if not shared:
        return None
    in_group = set(grouped)
    solo = [i for i in range(len(seq_lens)) if i not in in_group]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    grouped_t, solo_t = tensor(grouped), tensor(solo)
    grouped_rows = rows.index_select(0, grouped_t)
    suffix_lens = [seq_lens[i] - s for i, s in zip(grouped, member_shared, strict=True)]
    columns = tensor(member_shared)[:, None] + torch.arange(max(suffix_lens), device=device)[None, :]
    columns.clamp_(max=req_to_token.shape[1] - 1)  # past a request's own keys: never read
    return CascadePlan(
        grouped=grouped_t,
        grouped_rows=grouped_rows,
        group_starts=tensor(starts),
        shared_lens=tensor(shared),
        suffix_table=req_to_token[grouped_rows[:, None], columns].contiguous(),
        suffix_rows=torch.arange(len(grouped), device=device),
        suffix_lens=tensor(suffix_lens),
        solo=solo_t,
        solo_rows=rows.index_select(0, solo_t),
        solo_lens=tensor([seq_lens[i] for i in solo]),
    )


class CpuPagedAttention(AttentionBackend):
    name = "cpu_paged"
    priority = 7  # above torch_varlen (5); below the Triton kernels (10), which do not run on cpu anyway

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        self._kernels = load_kernel()

    @classmethod
    def build(cls) -> None:
        cpu_kernels.load()

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        reasons = grouped_heads_reasons(query) + attention_feature_reasons(
            query, cls.name, sliding_window=True, logit_softcap=True
        )
        reasons += cpu_kernels.query_reasons(query)
        kv_dtype = query.kv_dtype
        if kv_dtype is not None and kv_dtype != query.dtype and kv_dtype not in _KV_DTYPES.get(query.dtype, ()):
            reasons.append(
                f"a KV pool in {kv_dtype} under {query.dtype} compute is not supported "
                "(the pool holds the compute dtype, or bfloat16/float16 under float32)"
            )
        return reasons + cpu_kernels.unavailable_reasons()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        meta = PagedMetadata(batch.req_pool_indices.contiguous(), batch.seq_lens.contiguous())
        if batch.mode is ForwardMode.DECODE:
            num_heads, num_kv_heads = self.query.num_heads, self.query.num_kv_heads
            assert num_heads is not None and num_kv_heads is not None  # an attention query carries both
            meta.cascade = plan_cascade(batch.req_to_token, meta.rows, batch.seq_lens_cpu, num_heads // num_kv_heads)
        else:
            starts = [0]
            for n in batch.extend_lens_cpu:
                starts.append(starts[-1] + n)
            meta.q_starts = torch.tensor(starts, dtype=torch.int64, device=batch.seq_lens.device)
        batch.attn_metadata = meta

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> None:
        """One call of the kernels' own (``KVPool.set_kv`` is four torch calls per layer and step)."""
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        self._kernels.store_kv(k, v, batch.out_cache_loc, k_buf, v_buf)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta: PagedMetadata = batch.attn_metadata
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        window, cap = layer.sliding_window or 0, layer.logit_softcap or 0.0
        plan = meta.cascade
        if plan is None or window:  # a window skips the shared prefix's keys anyway
            q, out = _query_and_out(q)
            self._kernels.decode(
                q, k_buf, v_buf, batch.req_to_token, meta.rows, meta.kv_lens, layer.scaling, window, cap, out
            )
            return out
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.solo.numel():
            q_solo, out_solo = _query_and_out(q.index_select(0, plan.solo))
            self._kernels.decode(
                q_solo,
                k_buf,
                v_buf,
                batch.req_to_token,
                plan.solo_rows,
                plan.solo_lens,
                layer.scaling,
                0,
                cap,
                out_solo,
            )
            out.index_copy_(0, plan.solo, out_solo)
        # Each grouped request's own keys through the decode kernel (with their
        # log-sum-exp), then the shared prefixes in tiles, merged with them.
        q_grouped, own = _query_and_out(q.index_select(0, plan.grouped))
        own_lse = torch.empty(q_grouped.shape[:2], dtype=torch.float32, device=q.device)
        self._kernels.decode_with_lse(
            q_grouped,
            k_buf,
            v_buf,
            plan.suffix_table,
            plan.suffix_rows,
            plan.suffix_lens,
            layer.scaling,
            0,
            cap,
            own,
            own_lse,
        )
        out_grouped = torch.empty_like(own)
        self._kernels.cascade(
            q_grouped,
            k_buf,
            v_buf,
            batch.req_to_token,
            plan.grouped_rows,
            plan.group_starts,
            plan.shared_lens,
            own,
            own_lse,
            layer.scaling,
            cap,
            out_grouped,
        )
        out.index_copy_(0, plan.grouped, out_grouped)
        return out

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta: PagedMetadata = batch.attn_metadata
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        q, out = _query_and_out(q)
        self._kernels.extend(
            q,
            k_buf,
            v_buf,
            batch.req_to_token,
            meta.rows,
            meta.q_starts,
            meta.kv_lens,
            layer.scaling,
            layer.sliding_window or 0,
            layer.logit_softcap or 0.0,
            out,
        )
        return out


def _query_and_out(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel reads strided rows and heads (a view of a fused QKV projection)
    but needs each head's values contiguous; it writes a fresh contiguous output."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    return q, torch.empty(q.shape, dtype=q.dtype, device=q.device)
