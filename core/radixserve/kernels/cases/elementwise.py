"""Elementwise cases: ``ElementwiseCase`` (one call of an op: RMSNorm + residual,
rotary, SiLU-and-mul, the model-specific Gemma RMSNorm and GELU(tanh)-and-mul,
the sampler's grammar token mask), the inputs it makes
(``make_elementwise_inputs``) and ``run_elementwise_case`` (one call of the op,
its contract checked)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixserve.kernels.elementwise import MODEL_SPECIFIC_OPS, rope_cos_sin_cache
from radixserve.kernels.query import KernelQuery

ELEMENTWISE_OPS = ("rms_norm", "rotary", "silu_and_mul", "apply_token_bitmask") + MODEL_SPECIFIC_OPS
_NORMS = ("rms_norm", "gemma_rms_norm")


@dataclass(frozen=True)
class ElementwiseCase:
    """One call of an elementwise op on ``num_tokens`` rows.

    ``rms_norm``: ``hidden`` wide, with or without ``residual``; ``heads > 0``
    normalises per head (``x`` a strided ``[T, heads, hidden]`` view, as the q/k
    norms of Qwen3 see it). ``rotary``: q ``[T, heads, head_dim]`` and k
    ``[T, kv_heads, head_dim]``, ``rotary_dim`` (0: all of head_dim), NeoX or
    GPT-J pairs; ``strided`` makes q and k views of one fused QKV buffer (whose
    v part must stay untouched). ``silu_and_mul``: ``hidden`` is ``I``, the
    input ``[*lead, 2I]``. ``gemma_rms_norm`` and ``gelu_tanh_and_mul`` take
    the fields of ``rms_norm`` and ``silu_and_mul``; their query names the op
    (``KernelQuery.elementwise_ops``), so a backend without it skips the case.
    ``apply_token_bitmask``: logits ``[T, hidden]`` (``hidden`` the vocabulary),
    masked in the rows ``mask_rows`` (in that order)."""

    name: str
    op: str
    num_tokens: int
    hidden: int = 0
    residual: bool = False
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    rotary_dim: int = 0
    neox_style: bool = True
    strided: bool = False
    eps: float = 1e-6
    lead: tuple[int, ...] = ()  # silu_and_mul, gelu_tanh_and_mul: extra leading dims before the tokens
    mask_rows: tuple[int, ...] = ()  # apply_token_bitmask: the constrained rows

    def __post_init__(self) -> None:
        if self.op not in ELEMENTWISE_OPS:
            raise ValueError(f"op must be one of {ELEMENTWISE_OPS}, got {self.op!r}")
        if self.op == "rotary" and (self.rot_dim % 2 or self.rot_dim > self.head_dim):
            raise ValueError(f"rotary_dim {self.rot_dim} must be even and at most head_dim {self.head_dim}")
        rows = self.mask_rows
        distinct_rows = len(set(rows)) == len(rows) and set(rows) <= set(range(self.num_tokens))
        if self.op == "apply_token_bitmask" and not distinct_rows:
            raise ValueError(f"mask_rows {rows} must be distinct rows of the {self.num_tokens} logits rows")

    @property
    def rot_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def query(self, device: str, dtype: torch.dtype) -> KernelQuery:
        head_dim = self.head_dim if self.op == "rotary" else None
        ops = (self.op,) if self.op in MODEL_SPECIFIC_OPS else None
        return KernelQuery(device=device, dtype=dtype, head_dim=head_dim, elementwise_ops=ops)


_MAX_POSITIONS = 4096  # rows of the rotary cases' cos/sin table


def make_elementwise_inputs(
    case: ElementwiseCase,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    as_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """The op's inputs, drawn on CPU and rounded to ``dtype``, then put on
    ``device`` as ``as_dtype`` (default ``dtype``; the reference gets float32).
    ``rms_norm``: ``x`` (a view of ``buffer``), ``weight``, ``residual`` (or
    None); ``rotary``: ``q``, ``k`` (views of ``buffer`` when strided, else
    ``buffer`` is None), ``positions`` (unsorted, with repeats) and
    ``cos_sin_cache`` (built by :func:`radixserve.kernels.elementwise.rope_cos_sin_cache`,
    theta 10000); ``silu_and_mul``: ``x``. ``gemma_rms_norm`` as ``rms_norm``,
    its weight an offset from 1 (``N(0, 0.5^2)``); ``gelu_tanh_and_mul`` as
    ``silu_and_mul``. ``apply_token_bitmask``: ``logits``, ``bitmask`` (its words
    a mix of all-allowed, all-forbidden, single-token and random ones, as
    grammars give) and ``rows``."""
    gen = torch.Generator().manual_seed(seed)
    t, device = case.num_tokens, torch.device(device)

    def put(x: torch.Tensor) -> torch.Tensor:
        return x.to(device, as_dtype or dtype) if x.is_floating_point() else x.to(device)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return put((torch.randn(shape, generator=gen) * scale).to(dtype))

    buffer: torch.Tensor | None
    if case.op in _NORMS:
        if case.heads:  # per head: x is the first heads*hidden columns of a wider row
            buffer = randn(t, (case.heads + 2) * case.hidden)
            x = buffer[:, : case.heads * case.hidden].view(t, case.heads, case.hidden)
        else:
            buffer = x = randn(t, case.hidden, scale=2.0)
        if case.op == "rms_norm":
            weight = put((1 + 0.1 * torch.randn(case.hidden, generator=gen)).to(dtype))
        else:
            weight = put((0.5 * torch.randn(case.hidden, generator=gen)).to(dtype))
        residual = randn(*x.shape, scale=2.0) if case.residual else None
        return {"buffer": buffer, "x": x, "weight": weight, "residual": residual}
    if case.op == "rotary":
        d, h, kvh = case.head_dim, case.heads, case.kv_heads
        if case.strided:
            buffer = randn(t, (h + 2 * kvh) * d)
            q, k = buffer[:, : h * d].view(t, h, d), buffer[:, h * d : (h + kvh) * d].view(t, kvh, d)
        else:
            buffer, q, k = None, randn(t, h, d), randn(t, kvh, d)
        positions = torch.randint(0, _MAX_POSITIONS, (t,), generator=gen)
        positions[t // 2 :: 3] = positions[0]  # repeats, as the n>1 choices of one prompt have
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, case.rot_dim, 2, dtype=torch.float32) / case.rot_dim))
        cache = rope_cos_sin_cache(inv_freq, 1.0, _MAX_POSITIONS, dtype)
        return {"buffer": buffer, "q": q, "k": k, "positions": put(positions), "cos_sin_cache": put(cache)}
    if case.op == "apply_token_bitmask":
        return {"logits": randn(t, case.hidden, scale=4.0), **_token_bitmask(case, gen, device)}
    return {"x": randn(*case.lead, t, 2 * case.hidden, scale=2.0)}


def _token_bitmask(case: ElementwiseCase, gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    shape = (len(case.mask_rows), (case.hidden + 31) // 32)
    words = torch.randint(0, 2**32, shape, generator=gen, dtype=torch.int64)  # unsigned 32-bit words
    single = torch.ones(shape, dtype=torch.int64) << torch.randint(0, 32, shape, generator=gen)
    kind = torch.randint(0, 4, shape, generator=gen)
    words = torch.where(kind == 0, 2**32 - 1, torch.where(kind == 1, 0, torch.where(kind == 2, single, words)))
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as signed int32
    rows = torch.tensor(case.mask_rows, dtype=torch.int64)
    return {"bitmask": bitmask.to(device), "rows": rows.to(device)}


def run_elementwise_case(backend: Any, case: ElementwiseCase, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Call the op; return what it produced, by name. A broken contract raises."""
    if case.op in _NORMS:
        norm = getattr(backend, case.op)
        if case.residual:
            out, residual = norm(inputs["x"], inputs["weight"], case.eps, inputs["residual"])
            return {"out": out, "residual": residual}
        before = inputs["buffer"].clone()
        out = norm(inputs["x"], inputs["weight"], case.eps)
        if not torch.equal(inputs["buffer"], before):
            raise AssertionError(f"{case.op} without a residual modified its input")
        return {"out": out}
    if case.op == "rotary":
        result = backend.apply_rotary(
            inputs["q"], inputs["k"], inputs["positions"], inputs["cos_sin_cache"], case.neox_style
        )
        if result is not None:
            raise AssertionError(f"apply_rotary returned a {type(result).__name__}; it works in place")
        if inputs["buffer"] is not None:  # q, k and the v that must stay untouched, all in one
            return {"qkv": inputs["buffer"]}
        return {"q": inputs["q"], "k": inputs["k"]}
    if case.op == "apply_token_bitmask":
        logits = inputs["logits"]
        result = backend.apply_token_bitmask(logits, inputs["bitmask"], inputs["rows"])
        if result is not None:
            raise AssertionError(f"apply_token_bitmask returned a {type(result).__name__}; it works in place")
        forbidden = torch.isinf(logits) & (logits < 0)
        return {"forbidden": forbidden.to(logits.dtype), "kept": logits.masked_fill(forbidden, 0.0)}
    return {"out": getattr(backend, case.op)(inputs["x"])}
