"""Paged attention kernels over the radixserve KV pool.

The pool is ``[slots, kv_heads, head_dim]`` per layer; request ``r`` finds the
slot of its token ``j`` at ``req_to_token[r, j]``. The page size never matters
to these kernels: the slot table is per token, so pages of any size (and a
randomly permuted slot assignment) are read the same way.

Three kernels:

* ``store_kv``: scatter the step's new K/V rows into the pool at ``out_cache_loc``
  (converting to the pool dtype).
* decode: one query token per request. Flash-decoding in two stages: stage 1
  splits each request's keys into ``num_kv_splits`` ranges and, for one KV head
  and all the query heads that share it (GQA), computes a partial softmax
  (output and log-sum-exp); stage 2 merges the splits.
* extend: a block of new query tokens of one request and one head attends to
  the request's cached prefix and to the new keys, causally (key position <=
  query position). New keys are read back from the pool, where ``store_kv``
  has just put them.

Softmax runs in base 2 (``exp2``) with the scale folded in, accumulating in
float32; probabilities are rounded to the value dtype before the PV product.

A layer's sliding window and logit cap are compile-time constants of both
attention kernels (``SLIDING_WINDOW``, 0: none; ``LOGIT_SOFTCAP``, 0: none, else
the cap in base-2 units), so a layer without them compiles to the same code as
before. A windowed decode splits only its window's keys; a windowed extend block
starts at its first query's window and masks each row below its own; capped
scores are ``cap * tanh(score / cap)`` before the mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve_triton.config import DEFAULT_ATTENTION_CONFIG, AttentionKernelConfig
from radixserve_triton.ops.common import INTERPRETED, cast_to, jit, mma, next_pow2, rne_bf16, upcast_dots

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------
# KV store


@jit
def _store_kv_kernel(
    K: tl.tensor,
    V: tl.tensor,
    KCache: tl.tensor,
    VCache: tl.tensor,
    Loc: tl.tensor,
    num_tokens: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    stride_kct: tl.tensor,
    stride_kch: tl.tensor,
    stride_vct: tl.tensor,
    stride_vch: tl.tensor,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RNE_BF16: tl.constexpr,
) -> None:
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_mask = t < num_tokens
    mask = t_mask[:, None] & (d[None, :] < HEAD_DIM)
    loc = tl.load(Loc + t, mask=t_mask, other=0).to(tl.int64)
    k = tl.load(K + t[:, None].to(tl.int64) * stride_kt + head * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + t[:, None].to(tl.int64) * stride_vt + head * stride_vh + d[None, :], mask=mask)
    tl.store(
        KCache + loc[:, None] * stride_kct + head * stride_kch + d[None, :],
        cast_to(k, KCache.dtype.element_ty, RNE_BF16),
        mask=mask,
    )
    tl.store(
        VCache + loc[:, None] * stride_vct + head * stride_vch + d[None, :],
        cast_to(v, VCache.dtype.element_ty, RNE_BF16),
        mask=mask,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim with stride 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    config: AttentionKernelConfig = DEFAULT_ATTENTION_CONFIG,
) -> None:
    """``k_cache[loc] = k; v_cache[loc] = v`` (k/v ``[T, KVH, D]``, caches ``[S, KVH, D]``)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k, v = _rows(k), _rows(v)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    head_dim = k.shape[2]
    block_t = config.store_block_t
    grid = (triton.cdiv(num_tokens, block_t), k.shape[1])
    _store_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        loc,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_D=next_pow2(head_dim, 1),
        RNE_BF16=rne_bf16(k_cache.dtype) and k.dtype != k_cache.dtype,
        **config.launch_options(),
    )


# --------------------------------------------------------------------------
# Decode


@jit
def _online_softmax_step(
    s: tl.tensor,
    v: tl.tensor,
    m_i: tl.tensor,
    l_i: tl.tensor,
    acc: tl.tensor,
    UPCAST: tl.constexpr,
    RNE_BF16: tl.constexpr,
    EMPTY_ROWS: tl.constexpr = False,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Fold one block of base-2 scores ``s`` [M, N] and values ``v`` [N, D] into
    the running max ``m_i``, normalizer ``l_i`` and unnormalized output ``acc``.
    ``EMPTY_ROWS``: a row may have seen no key yet (below a sliding window): its
    max stays -inf and its exponentials are taken against 0, so they stay 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new) if EMPTY_ROWS else m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(cast_to(p, v.dtype, RNE_BF16), v, UPCAST)
    return m_new, l_i, acc


@jit
def _softcap(s: tl.tensor, CAP: tl.constexpr) -> tl.tensor:
    """``CAP * tanh(s / CAP)``, tanh as 1 - 2 / (e^2x + 1) (saturating to +-1)."""
    e = tl.exp2(s * (2.8853900817779268 / CAP))  # e^(2 s / CAP): 2.885... = 2 * log2(e)
    return CAP * (1.0 - 2.0 / (e + 1.0))


@jit
def _decode_partial_kernel(
    Q: tl.tensor,
    KCache: tl.tensor,
    VCache: tl.tensor,
    ReqToToken: tl.tensor,
    ReqPoolIdx: tl.tensor,
    SeqLens: tl.tensor,
    PartialO: tl.tensor,
    PartialLse: tl.tensor,
    qk_scale: tl.tensor,  # softmax scale * log2(e)
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_kct: tl.tensor,
    stride_kch: tl.tensor,
    stride_vct: tl.tensor,
    stride_vch: tl.tensor,
    stride_r2t: tl.tensor,
    stride_pob: tl.tensor,
    stride_poh: tl.tensor,
    stride_pos: tl.tensor,
    stride_plb: tl.tensor,
    stride_plh: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE_BF16: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    LOGIT_SOFTCAP: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    if SLIDING_WINDOW > 0:  # the splits cut the window's keys only
        first = tl.maximum(seq_len - SLIDING_WINDOW, 0)
        split_len = tl.cdiv(seq_len - first, NUM_SPLITS)
        start = first + split * split_len
    else:
        split_len = tl.cdiv(seq_len, NUM_SPLITS)
        start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    h_off = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + h_off
    h_mask = h_off < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM

    q = tl.load(
        Q + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        slot = tl.load(ReqToToken + req * stride_r2t + n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(KCache + slot[:, None] * stride_kct + kv_head * stride_kch + d[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k.to(q.dtype)), UPCAST) * qk_scale
        if LOGIT_SOFTCAP > 0:
            s = _softcap(s, LOGIT_SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        v = tl.load(VCache + slot[:, None] * stride_vct + kv_head * stride_vch + d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_softmax_step(s, v.to(q.dtype), m_i, l_i, acc, UPCAST, RNE_BF16)

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(
        PartialO + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + d[None, :],
        out,
        mask=h_mask[:, None] & d_mask[None, :],
    )
    tl.store(PartialLse + b * stride_plb + heads * stride_plh + split, lse, mask=h_mask)


@jit
def _decode_merge_kernel(
    PartialO: tl.tensor,
    PartialLse: tl.tensor,
    Out: tl.tensor,
    stride_pob: tl.tensor,
    stride_poh: tl.tensor,
    stride_pos: tl.tensor,
    stride_plb: tl.tensor,
    stride_plh: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    RNE_BF16: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    lse = tl.load(PartialLse + b * stride_plb + head * stride_plh + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: split 0 always holds the first key
    w = tl.exp2(lse - m)
    w = tl.where(s_mask, w, 0.0)
    o = tl.load(
        PartialO + b * stride_pob + head * stride_poh + s[:, None] * stride_pos + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(
        Out + b.to(tl.int64) * stride_ot + head * stride_oh + d,
        cast_to(out, Out.dtype.element_ty, RNE_BF16),
        mask=d_mask,
    )


def _base2_cap(logit_softcap: float | None) -> float:
    """The kernels' ``LOGIT_SOFTCAP``: the cap on base-2 scores (0.0: none)."""
    return float(logit_softcap) * LOG2E if logit_softcap else 0.0


def choose_num_kv_splits(
    batch_size: int, num_kv_heads: int, max_seq_len: int, config: AttentionKernelConfig = DEFAULT_ATTENTION_CONFIG
) -> int:
    """Split long sequences across programs when the batch alone cannot fill the
    device; each split keeps at least ``config.min_keys_per_split`` keys."""
    return config.num_kv_splits(batch_size, num_kv_heads, max_seq_len)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    num_kv_splits: int = 1,
    out: torch.Tensor | None = None,
    config: AttentionKernelConfig = DEFAULT_ATTENTION_CONFIG,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """``q`` ``[B, H, D]`` (one token per request) -> ``[B, H, D]``; each request
    attends to its last ``sliding_window`` keys (None: all), scores capped by
    ``logit_softcap`` (None: none)."""
    q = _rows(q)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    assert req_to_token.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_d = next_pow2(head_dim)
    splits = max(1, int(num_kv_splits))
    partial_o = torch.empty((batch, num_heads, splits, block_d), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    block_n = config.decode_block_n_for(head_dim)
    _decode_partial_kernel[(batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        partial_o,
        partial_lse,
        scaling * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        partial_o.stride(0),
        partial_o.stride(1),
        partial_o.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(group),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        UPCAST=upcast_dots(q.dtype),
        RNE_BF16=rne_bf16(q.dtype),
        SLIDING_WINDOW=sliding_window or 0,
        LOGIT_SOFTCAP=_base2_cap(logit_softcap),
        **config.launch_options(decode=True),
    )
    _decode_merge_kernel[(batch, num_heads)](
        partial_o,
        partial_lse,
        out,
        partial_o.stride(0),
        partial_o.stride(1),
        partial_o.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
        BLOCK_S=next_pow2(splits, 1),
        RNE_BF16=rne_bf16(out.dtype),
        **config.launch_options(decode=True),
    )
    return out


# --------------------------------------------------------------------------
# Extend (prefill over a cached prefix)


@jit
def _extend_kernel(
    Q: tl.tensor,
    KCache: tl.tensor,
    VCache: tl.tensor,
    Out: tl.tensor,
    ReqToToken: tl.tensor,
    ReqPoolIdx: tl.tensor,
    PrefixLens: tl.tensor,
    ExtendLens: tl.tensor,
    ExtendStart: tl.tensor,
    qk_scale: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_kct: tl.tensor,
    stride_kch: tl.tensor,
    stride_vct: tl.tensor,
    stride_vch: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_r2t: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE_BF16: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    LOGIT_SOFTCAP: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)

    extend_len = tl.load(ExtendLens + b).to(tl.int32)
    if m_block * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(PrefixLens + b).to(tl.int32)
    q_start = tl.load(ExtendStart + b).to(tl.int64)
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    kv_head = head // GROUP

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < extend_len
    q_pos = prefix_len + m  # absolute position of each query token
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + (q_start + m)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys this block can see: the prefix and the new tokens up to its last query
    # (from its first query's window on, in a windowed layer).
    end = tl.minimum(prefix_len + extend_len, prefix_len + (m_block + 1) * BLOCK_M)
    lo = tl.maximum(prefix_len + m_block * BLOCK_M - SLIDING_WINDOW + 1, 0) if SLIDING_WINDOW > 0 else 0
    for n0 in range(lo, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        slot = tl.load(ReqToToken + req * stride_r2t + n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(KCache + slot[:, None] * stride_kct + kv_head * stride_kch + d[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k.to(q.dtype)), UPCAST) * qk_scale
        if LOGIT_SOFTCAP > 0:
            s = _softcap(s, LOGIT_SOFTCAP)
        # Without a window key 0 is visible to every row, so no row is all -inf after
        # the first block; with one, a row may see nothing of a block (EMPTY_ROWS).
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (n[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(VCache + slot[:, None] * stride_vct + kv_head * stride_vch + d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_softmax_step(
            s, v.to(q.dtype), m_i, l_i, acc, UPCAST, RNE_BF16, EMPTY_ROWS=SLIDING_WINDOW > 0
        )

    if SLIDING_WINDOW > 0:  # noqa: SIM108 (a constexpr branch, compiled away)  padding rows past the last query may have seen no key
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    else:
        out = acc / l_i[:, None]
    tl.store(
        Out + (q_start + m)[:, None] * stride_ot + head * stride_oh + d[None, :],
        cast_to(out, Out.dtype.element_ty, RNE_BF16),
        mask=q_mask,
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start: torch.Tensor,
    max_extend_len: int,
    scaling: float,
    out: torch.Tensor | None = None,
    config: AttentionKernelConfig = DEFAULT_ATTENTION_CONFIG,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """``q`` ``[T, H, D]`` (the new tokens of all requests, in request order) -> ``[T, H, D]``;
    each query sees its last ``sliding_window`` keys (None: all up to it), scores
    capped by ``logit_softcap`` (None: none).

    The new tokens' K/V must already be in the pool (``store_kv``)."""
    q = _rows(q)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = int(prefix_lens.shape[0])
    if num_tokens == 0 or batch == 0:
        return out
    assert req_to_token.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_m = config.extend_block_m
    block_n = config.extend_block_n_for(head_dim, q.dtype)
    grid = (batch, num_heads, triton.cdiv(max(1, max_extend_len), block_m))
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start,
        scaling * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=next_pow2(head_dim),
        UPCAST=upcast_dots(q.dtype),
        RNE_BF16=rne_bf16(out.dtype),
        SLIDING_WINDOW=sliding_window or 0,
        LOGIT_SOFTCAP=_base2_cap(logit_softcap),
        **config.launch_options(),
    )
    return out


__all__ = ["INTERPRETED", "choose_num_kv_splits", "decode_attention", "extend_attention", "store_kv"]
