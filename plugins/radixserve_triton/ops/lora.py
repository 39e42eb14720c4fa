"""Batched LoRA as two segmented gather matmuls (SGMV, after Punica/S-LoRA).

A batch's tokens come in runs of one adapter slot (``LoRABatch``: device
tensors ``seg_start``, ``seg_len``, ``seg_slot``). Two kernels, each with a
program per (run, block of its tokens, block of columns):

1. shrink: ``s[t] = x[t] @ a[slot].T`` into a float32 ``[T, n * r]`` buffer
   (``n`` fused projections of rank ``r``: ``a`` stacks their A matrices);
2. expand: for each projection ``p`` (output rows ``[o_p, o_p + out_splits[p])``),
   ``out[t, rows_p] += s[t, p*r:(p+1)*r] @ b[slot, rows_p].T``, read-modify-write
   of ``out`` in the model dtype, rounded once. ``b`` is ``[slots, out, r]``: one
   launch covers up to three projections, its column blocks laid out projection
   by projection (so no block straddles two, and every block is one ``tl.dot``
   of its projection's rank columns; at most one partial block per projection).

No two programs share an output element (runs are disjoint), so there are no
atomics, and tokens in no run are never read nor written. The grids are sized
from the host's copy of the runs (how many, the longest) and of the splits,
so nothing waits on the device; a program past its own run's end exits at
once. K = n * r (24 for q/k/v of rank 8) and r need not be powers of two:
their tiles are masked. On a GPU in 16-bit dtypes the expand reads the
shrink rounded to the model dtype (tensor-core operands, as PEFT rounds it);
in float32 and in the interpreter it stays float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels import LoRABatch
from radixserve_triton.config import DEFAULT_LORA_CONFIG, LoRAKernelConfig
from radixserve_triton.ops.common import cast_to, jit, mma, rne_bf16, upcast_dots


@jit
def _lora_shrink_kernel(
    X: tl.tensor,
    A: tl.tensor,
    S: tl.tensor,
    SegStart: tl.tensor,
    SegLen: tl.tensor,
    SegSlot: tl.tensor,
    in_features: tl.tensor,
    rank: tl.tensor,
    stride_xt: tl.tensor,
    stride_xi: tl.tensor,
    stride_as: tl.tensor,
    stride_ak: tl.tensor,
    stride_ai: tl.tensor,
    stride_st: tl.tensor,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    UPCAST: tl.constexpr,
) -> None:
    seg = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_k = tl.program_id(2)
    length = tl.load(SegLen + seg)
    if pid_t * BLOCK_T >= length:
        return
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < length
    rows = (tl.load(SegStart + seg) + t).to(tl.int64)
    a_base = A + tl.load(SegSlot + seg).to(tl.int64) * stride_as
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = k < rank
    acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for i0 in range(0, in_features, BLOCK_IN):
        i = i0 + tl.arange(0, BLOCK_IN)
        i_mask = i < in_features
        x = tl.load(
            X + rows[:, None] * stride_xt + i[None, :] * stride_xi, mask=t_mask[:, None] & i_mask[None, :], other=0.0
        )
        a = tl.load(
            a_base + k[None, :] * stride_ak + i[:, None] * stride_ai, mask=i_mask[:, None] & k_mask[None, :], other=0.0
        )
        acc += mma(x, a, UPCAST)
    tl.store(S + rows[:, None] * stride_st + k[None, :], acc, mask=t_mask[:, None] & k_mask[None, :])


@jit
def _lora_expand_kernel(
    S: tl.tensor,
    B: tl.tensor,
    Out: tl.tensor,
    SegStart: tl.tensor,
    SegLen: tl.tensor,
    SegSlot: tl.tensor,
    size0: tl.tensor,
    size1: tl.tensor,
    size2: tl.tensor,
    rank: tl.tensor,
    stride_st: tl.tensor,
    stride_bs: tl.tensor,
    stride_bn: tl.tensor,
    stride_bk: tl.tensor,
    stride_ot: tl.tensor,
    stride_on: tl.tensor,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE_BF16: tl.constexpr,
) -> None:
    seg = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_n = tl.program_id(2)
    length = tl.load(SegLen + seg)
    if pid_t * BLOCK_T >= length:
        return
    # The column blocks are laid out projection by projection (size0's, then size1's,
    # then size2's), so a block never straddles two: its projection p, p's first
    # output row and size, and the block's place inside p.
    blocks0 = (size0 + BLOCK_N - 1) // BLOCK_N
    blocks01 = blocks0 + (size1 + BLOCK_N - 1) // BLOCK_N
    in1 = pid_n >= blocks0
    in2 = pid_n >= blocks01
    proj = tl.where(in2, 2, tl.where(in1, 1, 0))
    first_row = tl.where(in2, size0 + size1, tl.where(in1, size0, 0))
    size = tl.where(in2, size2, tl.where(in1, size1, size0))
    local = (pid_n - tl.where(in2, blocks01, tl.where(in1, blocks0, 0))) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = local < size
    n = first_row + local
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < length
    rows = (tl.load(SegStart + seg) + t).to(tl.int64)
    b_base = B + tl.load(SegSlot + seg).to(tl.int64) * stride_bs
    s_base = S + rows[:, None] * stride_st + proj * rank  # p's rank columns of the shrink
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < rank
        s = tl.load(s_base + k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(
            b_base + n[None, :] * stride_bn + k[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :], other=0.0
        )
        if UPCAST:  # float32 (or the interpreter): the shrink as it is
            acc += mma(s, b, UPCAST)
        else:  # 16-bit tensor-core operands: the shrink rounded to the model dtype
            acc += mma(s.to(b.dtype), b, UPCAST)
    out_ptrs = Out + rows[:, None] * stride_ot + n[None, :] * stride_on
    out_mask = t_mask[:, None] & n_mask[None, :]
    total = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32) + acc
    tl.store(out_ptrs, cast_to(total, Out.dtype.element_ty, RNE_BF16), mask=out_mask)


MAX_FUSED = 3  # projections one expand launch serves (q/k/v); a layer of more takes a launch per 3


def sgmv(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch: LoRABatch,
    out_splits: tuple[int, ...],
    config: LoRAKernelConfig = DEFAULT_LORA_CONFIG,
) -> None:
    """For the tokens ``t`` of each run of slot ``s`` and each projection ``j`` (output
    rows ``[o_j, o_j + out_splits[j])``), ``out[t, rows_j] += (x[t] @ a[s, j*r:(j+1)*r].T)
    @ b[s, rows_j].T``, in place: ``x`` ``[T, in]``, ``out`` ``[T, out]``, ``a``
    ``[slots, n * r, in]``, ``b`` ``[slots, out, r]`` (any strides)."""
    num_tokens, in_features = x.shape
    out_features = out.shape[1]
    rank, rank_columns = b.shape[2], a.shape[1]
    if rank_columns != len(out_splits) * rank or sum(out_splits) != out_features or b.shape[1] != out_features:
        raise ValueError(
            f"LoRA shapes disagree: a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}, "
            f"out_splits {out_splits}"
        )
    if not batch.segments or rank == 0:
        return
    max_len = batch.max_segment_len
    block_t, shrink_block_k = config.blocks(max_len, rank_columns)
    expand_block_k = config.blocks(max_len, rank)[1]
    block_n = config.expand_block_n
    shrunk = torch.empty((num_tokens, rank_columns), dtype=torch.float32, device=x.device)
    upcast = upcast_dots(x.dtype)
    runs, t_blocks = len(batch.segments), triton.cdiv(max_len, block_t)
    _lora_shrink_kernel[(runs, t_blocks, triton.cdiv(rank_columns, shrink_block_k))](
        x,
        a,
        shrunk,
        batch.seg_start,
        batch.seg_len,
        batch.seg_slot,
        in_features,
        rank_columns,
        x.stride(0),
        x.stride(1),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        shrunk.stride(0),
        BLOCK_T=block_t,
        BLOCK_K=shrink_block_k,
        BLOCK_IN=config.shrink_block_in,
        UPCAST=upcast,
        **config.launch_options(),
    )
    first_row = 0
    for first in range(0, len(out_splits), MAX_FUSED):  # one launch, unless a layer fuses more than 3
        sizes = out_splits[first : first + MAX_FUSED]
        rows = slice(first_row, first_row + sum(sizes))
        first_row = rows.stop
        shrunk_j, b_j, out_j = shrunk[:, first * rank :], b[:, rows], out[:, rows]
        padded = (*sizes, 0, 0)[:MAX_FUSED]
        n_blocks = sum(triton.cdiv(size, block_n) for size in sizes)
        if not n_blocks:
            continue
        _lora_expand_kernel[(runs, t_blocks, n_blocks)](
            shrunk_j,
            b_j,
            out_j,
            batch.seg_start,
            batch.seg_len,
            batch.seg_slot,
            *padded,
            rank,
            shrunk_j.stride(0),
            b_j.stride(0),
            b_j.stride(1),
            b_j.stride(2),
            out_j.stride(0),
            out_j.stride(1),
            BLOCK_T=block_t,
            BLOCK_N=block_n,
            BLOCK_K=expand_block_k,
            UPCAST=upcast,
            RNE_BF16=rne_bf16(out.dtype),
            **config.launch_options(),
        )


__all__ = ["sgmv"]
