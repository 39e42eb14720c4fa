"""Fused mixture-of-experts: top-k routed grouped GEMMs with SiLU gating.

Each (token, k) pair is an *assignment* ``a = token * top_k + k`` routed to
expert ``ids[token, k]``. ``align_assignments`` sorts the assignments by expert
and pads every expert's group to a multiple of ``BLOCK_M``, so one block of
``BLOCK_M`` rows always belongs to a single expert. Two kernels then run over
those blocks:

1. gate/up: ``act[a] = silu(x[t] @ W13[e, :I].T) * (x[t] @ W13[e, I:].T)``,
   both halves accumulated in the same program, activation fused, written in
   assignment order (``[T*k, I]``).
2. down: ``y[a] = w[a] * (act[a] @ W2[e].T)`` in float32 (``[T*k, H]``).

The host then sums the ``top_k`` rows of each token. The grids are sized by an
upper bound on the padded length, so nothing waits on the device; programs past
the real padded length exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve_triton.config import DEFAULT_MOE_CONFIG, MoEKernelConfig
from radixserve_triton.ops.common import cast_to, jit, mma, rne_bf16, upcast_dots


def align_assignments(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort ``ids`` ``[T, k]`` by expert, padding each expert's rows to ``block_m``.

    Returns ``sorted_ids`` (assignment index per padded row, ``T*k`` for
    padding), ``block_expert`` (expert of each block of ``block_m`` rows) and
    ``num_padded`` (a 1-element tensor: rows actually used)."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    device = flat.device
    # Not torch.bincount: on cuda it reads the largest id back to the host, which
    # a graph capture forbids (seen on an H100); a scatter-add stays on the device.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(n, device=device) - count_start[expert_of_sorted]
    dest = padded_start[expert_of_sorted] + rank

    max_rows = n + min(num_experts, n) * (block_m - 1)
    max_rows = triton.cdiv(max_rows, block_m) * block_m
    sorted_ids = torch.full((max_rows,), n, dtype=torch.int64, device=device)
    sorted_ids[dest] = order
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1)  # blocks past the end are skipped anyway
    num_padded = padded_end[-1:].clone()
    return sorted_ids, block_expert, num_padded


@jit
def _moe_gate_up_kernel(
    X: tl.tensor,
    W13: tl.tensor,
    Act: tl.tensor,
    SortedIds: tl.tensor,
    BlockExpert: tl.tensor,
    NumPadded: tl.tensor,
    num_assignments: tl.tensor,
    top_k: tl.tensor,
    hidden: tl.tensor,
    inter: tl.tensor,
    stride_xt: tl.tensor,
    stride_we: tl.tensor,
    stride_wn: tl.tensor,
    stride_at: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE_BF16: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    rows = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = rows < num_assignments
    token = rows // top_k
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < inter
    w_base = W13 + expert * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < hidden
        x = tl.load(X + token[:, None] * stride_xt + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(w_base + n[None, :] * stride_wn + kk[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (n + inter)[None, :] * stride_wn + kk[:, None], mask=w_mask, other=0.0)
        acc_gate += mma(x, w_gate.to(x.dtype), UPCAST)
        acc_up += mma(x, w_up.to(x.dtype), UPCAST)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(
        Act + rows[:, None] * stride_at + n[None, :],
        cast_to(act, Act.dtype.element_ty, RNE_BF16),
        mask=row_mask[:, None] & n_mask[None, :],
    )


@jit
def _moe_down_kernel(
    Act: tl.tensor,
    W2: tl.tensor,
    Out: tl.tensor,
    TopkWeights: tl.tensor,
    SortedIds: tl.tensor,
    BlockExpert: tl.tensor,
    NumPadded: tl.tensor,
    num_assignments: tl.tensor,
    hidden: tl.tensor,
    inter: tl.tensor,
    stride_at: tl.tensor,
    stride_we: tl.tensor,
    stride_wn: tl.tensor,
    stride_ot: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    rows = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = rows < num_assignments
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < hidden
    w_base = W2 + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < inter
        a = tl.load(Act + rows[:, None] * stride_at + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + n[None, :] * stride_wn + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += mma(a, w.to(a.dtype), UPCAST)
    weight = tl.load(TopkWeights + rows, mask=row_mask, other=0.0)
    acc = acc * weight[:, None]
    tl.store(Out + rows[:, None] * stride_ot + n[None, :], acc, mask=row_mask[:, None] & n_mask[None, :])


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoEKernelConfig = DEFAULT_MOE_CONFIG,
) -> torch.Tensor:
    """``hidden`` ``[T, H]``, ``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``,
    ``topk_weights`` float32 ``[T, k]``, ``topk_ids`` ``[T, k]`` -> ``[T, H]``."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    num_assignments = num_tokens * top_k
    # Few rows per expert (decode) -> small M blocks; large batches -> bigger.
    block_m, block_n, block_k = config.blocks(num_assignments, num_experts, hidden.dtype)
    sorted_ids, block_expert, num_padded = align_assignments(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty((num_assignments, inter), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((num_assignments, hidden_size), dtype=torch.float32, device=hidden.device)
    upcast = upcast_dots(hidden.dtype)
    m_blocks = sorted_ids.numel() // block_m

    _moe_gate_up_kernel[(m_blocks, triton.cdiv(inter, block_n))](
        hidden,
        w13,
        act,
        sorted_ids,
        block_expert,
        num_padded,
        num_assignments,
        top_k,
        hidden_size,
        inter,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast,
        RNE_BF16=rne_bf16(act.dtype),
        **config.launch_options(),
    )
    _moe_down_kernel[(m_blocks, triton.cdiv(hidden_size, block_n))](
        act,
        w2,
        out,
        weights,
        sorted_ids,
        block_expert,
        num_padded,
        num_assignments,
        hidden_size,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast,
        **config.launch_options(),
    )
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


__all__ = ["align_assignments", "fused_moe"]
