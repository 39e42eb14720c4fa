"""Elementwise kernels of a decoder layer, one launch per op:

- ``rms_norm``: a program normalises one or more whole rows; with a residual,
  the add, the store of the new residual and the norm happen in the same
  program (``residual`` and ``x`` are overwritten in place with the new
  residual and the output). Rows of up to ``MAX_BLOCK`` elements stay in
  registers; longer rows are walked twice (sum of squares, then normalise).
- ``apply_rotary``: one launch for q and k: each program rotates a block of
  (token, head) rows of q or of k in place, with each row's cos/sin.
- ``silu_and_mul``: ``silu(gate) * up`` over ``[rows, 2I] -> [rows, I]``, a
  block of output elements per program.
- ``gemma_rms_norm`` and ``gelu_tanh_and_mul`` (Gemma's): the same kernels with
  a compile-time switch: the weight applied as ``1 + w`` to the unrounded
  normalised value; GELU's tanh approximation in place of SiLU.

Numerics follow the torch reference: math in float32, rounded to the model
dtype where HuggingFace rounds (the new residual, the normalised value before
the weight, silu before the product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve_triton.ops.common import INTERPRETED, cast_to, jit, rne_bf16

MAX_BLOCK = 8192  # elements of a row held at once by rms_norm
_SILU_BLOCK = 1024
_GPU_ELEMENTS = 4096  # elements per program on a GPU
_INTERPRETER_ELEMENTS = 1 << 16


def _rows_per_program(rows: int, row_elements: int) -> int:
    """How many rows one program takes: a few thousand elements on a GPU (one
    row of a 4096-wide hidden state; 32 heads of 128), many more in the
    interpreter, whose cost is per program rather than per element."""
    budget = _INTERPRETER_ELEMENTS if INTERPRETED else _GPU_ELEMENTS
    rows_pow2: int = triton.next_power_of_2(rows)
    return max(1, min(rows_pow2, budget // row_elements))


@jit
def _scaled(
    normed: tl.tensor, w: tl.tensor, dtype: tl.constexpr, RNE_BF16: tl.constexpr, GEMMA: tl.constexpr
) -> tl.tensor:
    """The normalised value times the weight, in the model dtype: rounded first, then
    times ``w`` (Llama's RMSNorm); or times ``1 + w`` in float32, rounded once (Gemma's)."""
    if GEMMA:
        return cast_to(normed * (1.0 + w), dtype, RNE_BF16)
    return cast_to(cast_to(normed, dtype, RNE_BF16).to(tl.float32) * w, dtype, RNE_BF16)


@jit
def _rms_norm_kernel(
    X: tl.tensor,
    R: tl.tensor,
    W: tl.tensor,
    Out: tl.tensor,
    n_rows: tl.tensor,
    n_inner: tl.tensor,
    stride_x0: tl.tensor,
    stride_x1: tl.tensor,
    stride_r: tl.tensor,
    stride_o0: tl.tensor,
    stride_o1: tl.tensor,
    hidden: tl.tensor,
    eps: tl.tensor,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    RNE_BF16: tl.constexpr,
    GEMMA: tl.constexpr,
) -> None:
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = (rows < n_rows)[:, None]
    outer, inner = rows // n_inner, rows % n_inner
    x_rows = X + (outer * stride_x0 + inner * stride_x1)[:, None]
    o_rows = Out + (outer * stride_o0 + inner * stride_o1)[:, None]
    r_rows = R + (rows * stride_r)[:, None]
    dtype = Out.dtype.element_ty
    cols = tl.arange(0, BLOCK)[None, :]
    if ONE_BLOCK:  # the whole row stays in registers
        mask = row_mask & (cols < hidden)
        h = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h = h + tl.load(r_rows + cols, mask=mask, other=0.0).to(tl.float32)
            h_dtype = cast_to(h, dtype, RNE_BF16)  # the residual add rounds to the model dtype
            tl.store(r_rows + cols, h_dtype, mask=mask)
            h = h_dtype.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / hidden + eps)
        w = tl.load(W + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        tl.store(o_rows + cols, _scaled(h * inv_rms[:, None], w, dtype, RNE_BF16, GEMMA), mask=mask)
    else:  # long rows: sum of squares (and the new residual) first, then normalise
        sum_sq = tl.zeros([BLOCK_ROWS, BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            c = start + cols
            mask = row_mask & (c < hidden)
            h = tl.load(x_rows + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h = h + tl.load(r_rows + c, mask=mask, other=0.0).to(tl.float32)
                h_dtype = cast_to(h, dtype, RNE_BF16)
                tl.store(r_rows + c, h_dtype, mask=mask)
                h = h_dtype.to(tl.float32)
            sum_sq += h * h
        inv_rms = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=1) / hidden + eps)
        tl.debug_barrier()  # the new residual is read back below
        for start in range(0, hidden, BLOCK):
            c = start + cols
            mask = row_mask & (c < hidden)
            if HAS_RESIDUAL:
                h = tl.load(r_rows + c, mask=mask, other=0.0).to(tl.float32)
            else:
                h = tl.load(x_rows + c, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + c, mask=c < hidden, other=0.0).to(tl.float32)
            tl.store(o_rows + c, _scaled(h * inv_rms[:, None], w, dtype, RNE_BF16, GEMMA), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, gemma: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    if residual is None:
        # Read x where it lies (e.g. the q heads of a fused QKV output, [T, heads, D]).
        src = x if x.dim() == 3 else x.reshape(-1, 1, hidden)
        if src.stride(-1) != 1:
            src = src.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dst, res = out.view(src.shape), src  # res: an unused pointer
    else:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        src = dst = _rows(x).unsqueeze(1)  # the output overwrites x ...
        res = _rows(residual)  # ... and the new residual the old one
    rows = src.shape[0] * src.shape[1]
    if rows:
        block = min(triton.next_power_of_2(hidden), MAX_BLOCK)
        one_block = block >= hidden
        block_rows = _rows_per_program(rows, block) if one_block else 1
        _rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
            src,
            res,
            weight,
            dst,
            rows,
            src.shape[1],
            src.stride(0),
            src.stride(1),
            res.stride(0),
            dst.stride(0),
            dst.stride(1),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_ROWS=block_rows,
            BLOCK=block,
            ONE_BLOCK=one_block,
            RNE_BF16=rne_bf16(x.dtype),
            GEMMA=gemma,
            num_warps=4 if block_rows * block <= 2048 else 8,
        )
    if residual is None:
        return out
    return dst.reshape(x.shape), res.reshape(residual.shape)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, H]`` with a contiguous last dimension (a view when possible)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@jit
def _rotate_rows(
    base: tl.tensor,
    Positions: tl.tensor,
    CosSin: tl.tensor,
    first_row: tl.tensor,
    n_rows: tl.tensor,
    n_heads: tl.tensor,
    stride_t: tl.tensor,
    stride_h: tl.tensor,
    stride_cache: tl.tensor,
    HALF: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NEOX: tl.constexpr,
    RNE_BF16: tl.constexpr,
) -> None:
    """Rotate ``BLOCK_ROWS`` (token, head) rows of ``base`` in place, from ``first_row``."""
    rows = first_row + tl.arange(0, BLOCK_ROWS)
    token, head = rows // n_heads, rows % n_heads
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (rows < n_rows)[:, None] & (i < HALF)
    pos = tl.load(Positions + token, mask=rows < n_rows, other=0).to(tl.int64)[:, None]
    cos = tl.load(CosSin + pos * stride_cache + i, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(CosSin + pos * stride_cache + HALF + i, mask=mask, other=0.0).to(tl.float32)
    if NEOX:  # x[i] pairs with x[i + HALF]
        off1 = i
        off2 = i + HALF
    else:  # x[2i] pairs with x[2i + 1]
        off1 = 2 * i
        off2 = 2 * i + 1
    row = base + (token * stride_t + head * stride_h)[:, None]
    x1 = tl.load(row + off1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + off2, mask=mask, other=0.0).to(tl.float32)
    dtype = base.dtype.element_ty
    tl.store(row + off1, cast_to(x1 * cos - x2 * sin, dtype, RNE_BF16), mask=mask)
    tl.store(row + off2, cast_to(x2 * cos + x1 * sin, dtype, RNE_BF16), mask=mask)


@jit
def _rotary_kernel(
    Q: tl.tensor,
    K: tl.tensor,
    Positions: tl.tensor,
    CosSin: tl.tensor,
    num_tokens: tl.tensor,
    num_q_heads: tl.tensor,
    num_k_heads: tl.tensor,
    q_programs: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_cache: tl.tensor,
    HALF: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NEOX: tl.constexpr,
    RNE_BF16: tl.constexpr,
) -> None:
    """The first ``q_programs`` programs rotate q's (token, head) rows, the rest k's."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < q_programs:
        _rotate_rows(
            Q,
            Positions,
            CosSin,
            pid * BLOCK_ROWS,
            num_tokens * num_q_heads,
            num_q_heads,
            stride_qt,
            stride_qh,
            stride_cache,
            HALF,
            BLOCK_ROWS,
            BLOCK_HALF,
            NEOX,
            RNE_BF16,
        )
    else:
        _rotate_rows(
            K,
            Positions,
            CosSin,
            (pid - q_programs) * BLOCK_ROWS,
            num_tokens * num_k_heads,
            num_k_heads,
            stride_kt,
            stride_kh,
            stride_cache,
            HALF,
            BLOCK_ROWS,
            BLOCK_HALF,
            NEOX,
            RNE_BF16,
        )


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, neox_style: bool
) -> None:
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 3 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [tokens, heads, head_dim] with a contiguous last dimension")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > q.shape[-1] or rotary_dim > k.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {q.shape[-1]}")
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    tokens = q.shape[0]
    if tokens == 0:
        return
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    block_rows = _rows_per_program(tokens * max(q.shape[1], k.shape[1]), 2 * block_half)
    q_programs = triton.cdiv(tokens * q.shape[1], block_rows)
    k_programs = triton.cdiv(tokens * k.shape[1], block_rows)
    _rotary_kernel[(q_programs + k_programs,)](
        q,
        k,
        positions,
        cos_sin_cache,
        tokens,
        q.shape[1],
        k.shape[1],
        q_programs,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        HALF=half,
        BLOCK_ROWS=block_rows,
        BLOCK_HALF=block_half,
        NEOX=neox_style,
        RNE_BF16=rne_bf16(q.dtype),
        num_warps=4,
    )


GELU_TANH_C = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)


@jit
def _act_and_mul_kernel(
    X: tl.tensor,
    Out: tl.tensor,
    n_elements: tl.tensor,
    inter: tl.tensor,
    stride_x: tl.tensor,
    stride_o: tl.tensor,
    BLOCK: tl.constexpr,
    RNE_BF16: tl.constexpr,
    GELU_TANH: tl.constexpr,
) -> None:
    """Element ``e`` of the output ``[rows, I]``: row ``e // I``, column ``e % I``."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < n_elements
    row, col = e // inter, e % inter
    dtype = Out.dtype.element_ty
    gate = tl.load(X + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + inter + col, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:  # 0.5 x (1 + tanh(c (x + 0.044715 x^3))), tanh(u) as 1 - 2 / (e^(2u) + 1)
        u = GELU_TANH_C * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = cast_to(act, dtype, RNE_BF16).to(tl.float32)  # the activation rounds, as torch's does
    tl.store(Out + row * stride_o + col, cast_to(act * up, dtype, RNE_BF16), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, "silu_and_mul", gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, "gelu_tanh_and_mul", gelu_tanh=True)


def _act_and_mul(x: torch.Tensor, op: str, gelu_tanh: bool) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"{op} needs an even last dimension, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    n_elements = out.numel()
    if n_elements == 0:
        return out
    rows_in = _rows(x)
    block = _SILU_BLOCK * _rows_per_program(n_elements, _SILU_BLOCK) if INTERPRETED else _SILU_BLOCK
    _act_and_mul_kernel[(triton.cdiv(n_elements, block),)](
        rows_in,
        out,
        n_elements,
        inter,
        rows_in.stride(0),
        inter,
        BLOCK=block,
        RNE_BF16=rne_bf16(x.dtype),
        GELU_TANH=gelu_tanh,
        num_warps=4,
    )
    return out
