"""The elementwise kit (RMSNorm + residual, rotary, SiLU-and-mul, the
model-specific Gemma RMSNorm and GELU(tanh)-and-mul, and the sampler's grammar
token mask):
``ElementwiseCase`` and its case sets, ``make_elementwise_inputs``,
``run_elementwise_case`` (one call of the op, its contract checked) and
``check_elementwise_backend``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.kernels import MODEL_SPECIFIC_OPS, KernelQuery
from radixserve.testing.conformance.base import (
    BackendSpec,
    CaseResult,
    ConformanceReport,
    Tolerance,
    Tolerances,
    _cases,
    _Run,
    _score,
)

ELEMENTWISE_OPS = ("rms_norm", "rotary", "silu_and_mul", "apply_token_bitmask") + MODEL_SPECIFIC_OPS
_NORMS = ("rms_norm", "gemma_rms_norm")
EXACT = Tolerance(atol=0.0, rtol=0.0)


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

    def __post_init__(self):
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


def _norm(name, tokens, hidden, **kw) -> ElementwiseCase:
    return ElementwiseCase(name, "rms_norm", tokens, hidden=hidden, **kw)


def _rope(name, tokens, heads, kv_heads, head_dim, **kw) -> ElementwiseCase:
    return ElementwiseCase(name, "rotary", tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, **kw)


def _silu(name, tokens, inter, **kw) -> ElementwiseCase:
    return ElementwiseCase(name, "silu_and_mul", tokens, hidden=inter, **kw)


def _gemma_norm(name, tokens, hidden, **kw) -> ElementwiseCase:
    return ElementwiseCase(name, "gemma_rms_norm", tokens, hidden=hidden, **kw)


def _gelu(name, tokens, inter, **kw) -> ElementwiseCase:
    return ElementwiseCase(name, "gelu_tanh_and_mul", tokens, hidden=inter, **kw)


def _mask(name, tokens, vocab, rows) -> ElementwiseCase:
    return ElementwiseCase(name, "apply_token_bitmask", tokens, hidden=vocab, mask_rows=tuple(rows))


_ELEM_QUICK = (
    _norm("rms_norm/T3/H64", 3, 64),
    _norm("rms_norm/residual/T5/H1000", 5, 1000, residual=True, eps=1e-5),
    _norm("rms_norm/residual/T2/H10000", 2, 10000, residual=True),  # longer than one block of the Triton kernel
    _norm("rms_norm/per-head/T4/4x128", 4, 128, heads=4),
    _rope("rotary/neox/d128/qkv-view/T6", 6, 4, 2, 128, strided=True),
    _rope("rotary/gptj/d64/T3", 3, 2, 1, 64, neox_style=False),
    _rope("rotary/neox/d64/partial32/T4", 4, 3, 1, 64, rotary_dim=32, strided=True),
    _silu("silu_and_mul/T3/I96", 3, 96),
    _silu("silu_and_mul/T5/I1000", 5, 1000),
    _gemma_norm("gemma_rms_norm/residual/T5/H1000", 5, 1000, residual=True),
    _gemma_norm("gemma_rms_norm/per-head/T4/4x256", 4, 256, heads=4),
    _gelu("gelu_tanh_and_mul/T5/I1000", 5, 1000),
    _mask("apply_token_bitmask/T3/V100/rows-2-0", 3, 100, (2, 0)),
)
_ELEM_STANDARD = _ELEM_QUICK + (
    _norm("rms_norm/T1/H4096", 1, 4096),
    _norm("rms_norm/residual/T300/H4096", 300, 4096, residual=True),
    _norm("rms_norm/residual/T1/H64", 1, 64, residual=True),
    _norm("rms_norm/T257/H777", 257, 777, eps=1e-5),
    _norm("rms_norm/per-head/T300/8x64", 300, 64, heads=8),
    _rope("rotary/neox/d128/qkv-view/T300", 300, 8, 2, 128, strided=True),
    _rope("rotary/gptj/d128/T257", 257, 4, 4, 128, neox_style=False),
    _rope("rotary/neox/d64/T1", 1, 16, 8, 64),
    _rope("rotary/gptj/d128/partial64/qkv-view/T9", 9, 4, 2, 128, rotary_dim=64, neox_style=False, strided=True),
    _silu("silu_and_mul/T1/I4096", 1, 4096),
    _silu("silu_and_mul/T300/I1376", 300, 1376),
    _silu("silu_and_mul/3d/2x7/I80", 7, 80, lead=(2,)),
    _gemma_norm("gemma_rms_norm/T1/H2304", 1, 2304),
    _gemma_norm("gemma_rms_norm/residual/T300/H3584", 300, 3584, residual=True),
    _gelu("gelu_tanh_and_mul/T300/I9216", 300, 9216),
    _gelu("gelu_tanh_and_mul/3d/2x7/I80", 7, 80, lead=(2,)),
    _mask("apply_token_bitmask/T1/V31/all", 1, 31, (0,)),
    _mask("apply_token_bitmask/T32/V151936/all", 32, 151936, range(32)),
    _mask("apply_token_bitmask/T12/V32001/5-rows", 12, 32001, (7, 1, 11, 4, 0)),
)
_ELEM_FULL = _ELEM_STANDARD + (
    _norm("rms_norm/residual/T2048/H8192", 2048, 8192, residual=True),
    _norm("rms_norm/residual/T64/H16384", 64, 16384, residual=True),
    _rope("rotary/neox/d128/qkv-view/T4096", 4096, 32, 8, 128, strided=True),
    _silu("silu_and_mul/T2048/I14336", 2048, 14336),
    _gemma_norm("gemma_rms_norm/residual/T2048/H4608", 2048, 4608, residual=True),
    _gelu("gelu_tanh_and_mul/T2048/I14336", 2048, 14336),
)
ELEMENTWISE_CASES: dict[str, tuple[ElementwiseCase, ...]] = {
    "quick": _ELEM_QUICK,
    "standard": _ELEM_STANDARD,
    "full": _ELEM_FULL,
}

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
    ``cos_sin_cache`` (built by :func:`radixserve.layers.rotary.rope_cos_sin_cache`,
    theta 10000); ``silu_and_mul``: ``x``. ``gemma_rms_norm`` as ``rms_norm``,
    its weight an offset from 1 (``N(0, 0.5^2)``); ``gelu_tanh_and_mul`` as
    ``silu_and_mul``. ``apply_token_bitmask``: ``logits``, ``bitmask`` (its words
    a mix of all-allowed, all-forbidden, single-token and random ones, as
    grammars give) and ``rows``."""
    from radixserve.layers.rotary import rope_cos_sin_cache

    gen = torch.Generator().manual_seed(seed)
    t, device = case.num_tokens, torch.device(device)

    def put(x: torch.Tensor) -> torch.Tensor:
        return x.to(device, as_dtype or dtype) if x.is_floating_point() else x.to(device)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return put((torch.randn(shape, generator=gen) * scale).to(dtype))

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


def check_elementwise_backend(
    backend: BackendSpec,
    device: str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    registry=None,
    *,
    cases: str | Sequence[ElementwiseCase] = "standard",
    reference: BackendSpec = "torch_native",
    tolerances: Tolerances = None,
    seed: int = 0,
) -> ConformanceReport:
    """Run ``rms_norm`` (with and without the fused residual, per head on a
    strided view), ``apply_rotary`` (NeoX and GPT-J, head dims 64 and 128,
    partial, on views of a fused QKV buffer), ``silu_and_mul``, the
    model-specific ``gemma_rms_norm`` and ``gelu_tanh_and_mul`` (skipped by a
    backend that refuses them) and ``apply_token_bitmask`` (which tokens became
    -inf, and every other value, exactly) on ``backend``. Every output is compared (both of ``rms_norm`` with a
    residual; the whole QKV buffer after rotary, so v must be untouched);
    ``rms_norm`` without a residual must leave its input alone."""
    run = _Run.resolve("elementwise", backend, device, dtypes, registry, reference)
    case_list = _cases("elementwise", cases, ELEMENTWISE_CASES)

    def check_one(case, dtype, query, tol, result, case_seed):
        if case.op == "apply_token_bitmask":
            tol = EXACT  # a mask changes no value but the forbidden ones
            result.atol, result.rtol = tol.atol, tol.rtol
        ref_inputs = make_elementwise_inputs(case, dtype, "cpu", case_seed, as_dtype=torch.float32)
        expected = run_elementwise_case(run.ref_cls(run.reference_query(query)), case, ref_inputs)
        inputs = make_elementwise_inputs(case, dtype, run.torch_device, case_seed)
        outputs = run_elementwise_case(run.cls(query), case, inputs)
        parts = []
        for name, want in expected.items():  # every output; the case reports the worst
            part = CaseResult(case.name, result.dtype, False)
            part.passed = _score(part, outputs[name], want, dtype, tol)
            parts.append(part)
            if part.error:
                result.error = result.error or f"{name}: {part.error}"
        measured = [p for p in parts if not math.isnan(p.max_abs)]
        if measured:
            result.max_abs = max(p.max_abs for p in measured)
            result.max_rel = max(p.max_rel for p in measured)
        result.passed = all(p.passed for p in parts) and result.error is None

    return run.check_each(case_list, tolerances, seed, check_one)
