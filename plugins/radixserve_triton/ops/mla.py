"""Multi-head latent attention decode over the latent pool (absorbed form; see
radixserve/kernels/mla.py).

The pool is ``[slots, kv_lora_rank + rope]`` per layer: every head of a request
reads the same entries. A query is already absorbed: per head, a latent part
``q_latent = q_nope @ W_UK`` (``kv_lora_rank`` wide) and the rotary part. The
score of key ``s`` is ``q_latent . c(s) + q_rope . k_rope(s)`` and the output,
before ``W_UV``, is the softmax-weighted sum of the latents ``c(s)``.

Flash-decoding in two stages, as ``ops/attention.py``'s decode: stage 1 splits
each request's keys into ``num_kv_splits`` ranges; a program takes a block of
``BLOCK_H`` heads and one range, loads each block of entries once for all of
its heads, and uses the latent it loaded both for the scores and as the values
(the pool holds nothing else), keeping a partial softmax (output and
log-sum-exp). Stage 2 is the merge kernel of ``ops/attention.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve_triton.config import DEFAULT_ATTENTION_CONFIG, AttentionKernelConfig
from radixserve_triton.ops.attention import LOG2E, _decode_merge_kernel, _online_softmax_step
from radixserve_triton.ops.common import jit, mma, next_pow2, rne_bf16, upcast_dots

BLOCK_HEADS = 16  # heads per program: each block of entries is loaded once for all of them


@jit
def _mla_decode_partial_kernel(
    QLatent: tl.tensor,
    QRope: tl.tensor,
    Entries: tl.tensor,
    ReqToToken: tl.tensor,
    ReqPoolIdx: tl.tensor,
    SeqLens: tl.tensor,
    PartialO: tl.tensor,
    PartialLse: tl.tensor,
    qk_scale: tl.tensor,  # softmax scale * log2(e)
    stride_qlt: tl.tensor,
    stride_qlh: tl.tensor,
    stride_qrt: tl.tensor,
    stride_qrh: tl.tensor,
    stride_e: tl.tensor,
    stride_r2t: tl.tensor,
    stride_pob: tl.tensor,
    stride_poh: tl.tensor,
    stride_pos: tl.tensor,
    stride_plb: tl.tensor,
    stride_plh: tl.tensor,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE_BF16: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < NUM_HEADS
    lat = tl.arange(0, BLOCK_L)
    lat_mask = lat < RANK
    rot = tl.arange(0, BLOCK_R)
    rot_mask = rot < ROPE

    q_latent = tl.load(
        QLatent + b.to(tl.int64) * stride_qlt + heads[:, None] * stride_qlh + lat[None, :],
        mask=h_mask[:, None] & lat_mask[None, :],
        other=0.0,
    )
    q_rope = tl.load(
        QRope + b.to(tl.int64) * stride_qrt + heads[:, None] * stride_qrh + rot[None, :],
        mask=h_mask[:, None] & rot_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        slot = tl.load(ReqToToken + req * stride_r2t + n, mask=n_mask, other=0).to(tl.int64)
        latent = tl.load(
            Entries + slot[:, None] * stride_e + lat[None, :], mask=n_mask[:, None] & lat_mask[None, :], other=0.0
        ).to(q_latent.dtype)
        k_rope = tl.load(
            Entries + slot[:, None] * stride_e + RANK + rot[None, :],
            mask=n_mask[:, None] & rot_mask[None, :],
            other=0.0,
        ).to(q_rope.dtype)
        s = (mma(q_latent, tl.trans(latent), UPCAST) + mma(q_rope, tl.trans(k_rope), UPCAST)) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, latent, m_i, l_i, acc, UPCAST, RNE_BF16)

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(
        PartialO + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + lat[None, :],
        out,
        mask=h_mask[:, None] & lat_mask[None, :],
    )
    tl.store(PartialLse + b * stride_plb + heads * stride_plh + split, lse, mask=h_mask)


def num_head_blocks(num_heads: int) -> int:
    blocks: int = triton.cdiv(num_heads, BLOCK_HEADS)
    return blocks


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    entries: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    num_kv_splits: int = 1,
    config: AttentionKernelConfig = DEFAULT_ATTENTION_CONFIG,
) -> torch.Tensor:
    """``q_latent`` ``[B, H, kv_lora_rank]`` and ``q_rope`` ``[B, H, rope]`` (one
    token per request) over ``entries`` ``[slots, kv_lora_rank + rope]`` ->
    the attention-weighted latents ``[B, H, kv_lora_rank]`` in ``q_latent.dtype``."""
    batch, num_heads, rank = q_latent.shape
    rope = q_rope.shape[2]
    out = torch.empty((batch, num_heads, rank), dtype=q_latent.dtype, device=q_latent.device)
    if batch == 0:
        return out
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    if q_rope.stride(-1) != 1:
        q_rope = q_rope.contiguous()
    assert req_to_token.stride(-1) == 1 and entries.stride(-1) == 1
    block_l = next_pow2(rank)
    splits = max(1, int(num_kv_splits))
    partial_o = torch.empty((batch, num_heads, splits, block_l), dtype=torch.float32, device=q_latent.device)
    partial_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q_latent.device)
    _mla_decode_partial_kernel[(batch, num_head_blocks(num_heads), splits)](
        q_latent,
        q_rope,
        entries,
        req_to_token,
        req_pool_indices,
        seq_lens,
        partial_o,
        partial_lse,
        scaling * LOG2E,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        entries.stride(0),
        req_to_token.stride(0),
        partial_o.stride(0),
        partial_o.stride(1),
        partial_o.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        NUM_HEADS=num_heads,
        RANK=rank,
        ROPE=rope,
        BLOCK_H=BLOCK_HEADS,
        BLOCK_L=block_l,
        BLOCK_R=next_pow2(rope),
        BLOCK_N=config.decode_block_n_for(rank + rope),
        NUM_SPLITS=splits,
        UPCAST=upcast_dots(q_latent.dtype),
        RNE_BF16=rne_bf16(q_latent.dtype),
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
        HEAD_DIM=rank,
        BLOCK_D=block_l,
        NUM_SPLITS=splits,
        BLOCK_S=next_pow2(splits, 1),
        RNE_BF16=rne_bf16(out.dtype),
        **config.launch_options(decode=True),
    )
    return out
