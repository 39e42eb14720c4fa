"""The elementwise kit (RMSNorm + residual, rotary, SiLU-and-mul, the
model-specific Gemma RMSNorm and GELU(tanh)-and-mul, and the sampler's grammar
token mask): ``ElementwiseCase``'s case sets and ``check_elementwise_backend``.
The case class, ``make_elementwise_inputs`` and ``run_elementwise_case`` (one
call of the op, its contract checked) live in
radixserve/kernels/cases/elementwise.py, which ``auto``'s timing uses too."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from radixserve.kernels import KernelQuery
from radixserve.kernels.cases.elementwise import ElementwiseCase, make_elementwise_inputs, run_elementwise_case
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

if TYPE_CHECKING:
    from radixserve.registry import PluginRegistry

EXACT = Tolerance(atol=0.0, rtol=0.0)


def _norm(name: str, tokens: int, hidden: int, **kw: Any) -> ElementwiseCase:
    return ElementwiseCase(name, "rms_norm", tokens, hidden=hidden, **kw)


def _rope(name: str, tokens: int, heads: int, kv_heads: int, head_dim: int, **kw: Any) -> ElementwiseCase:
    return ElementwiseCase(name, "rotary", tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, **kw)


def _silu(name: str, tokens: int, inter: int, **kw: Any) -> ElementwiseCase:
    return ElementwiseCase(name, "silu_and_mul", tokens, hidden=inter, **kw)


def _gemma_norm(name: str, tokens: int, hidden: int, **kw: Any) -> ElementwiseCase:
    return ElementwiseCase(name, "gemma_rms_norm", tokens, hidden=hidden, **kw)


def _gelu(name: str, tokens: int, inter: int, **kw: Any) -> ElementwiseCase:
    return ElementwiseCase(name, "gelu_tanh_and_mul", tokens, hidden=inter, **kw)


def _mask(name: str, tokens: int, vocab: int, rows: Iterable[int]) -> ElementwiseCase:
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


def check_elementwise_backend(
    backend: BackendSpec,
    device: str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    registry: PluginRegistry | None = None,
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

    def check_one(
        case: ElementwiseCase,
        dtype: torch.dtype,
        query: KernelQuery,
        tol: Tolerance,
        result: CaseResult,
        case_seed: int,
    ) -> None:
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
