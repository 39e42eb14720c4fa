"""The GEMM kit: ``GemmCase`` and its case sets (``linear``, and the fused
``linear_silu_and_mul`` where a backend has it) and ``check_gemm_backend``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.kernels import KernelQuery
from radixserve.testing.conformance.base import (
    BackendSpec,
    CaseResult,
    ConformanceReport,
    SkippedCase,
    Tolerance,
    Tolerances,
    _cases,
    _dtype_name,
    _f32,
    _Run,
    _score,
)

if TYPE_CHECKING:
    from radixserve.registry import PluginRegistry


@dataclass(frozen=True)
class GemmCase:
    name: str
    batch_shape: tuple[int, ...]  # leading dims of x
    in_features: int
    out_features: int
    bias: bool
    # ``linear_silu_and_mul``: silu(gate) * up of the output's halves, fused; a backend
    # that returns None for it (no such kernel) has the case skipped.
    silu_and_mul: bool = False

    def query(self, device: str, dtype: torch.dtype) -> KernelQuery:
        return KernelQuery(device=device, dtype=dtype)


_GEMM_QUICK = (
    GemmCase("M1/K64/N128", (1,), 64, 128, False),
    GemmCase("M7/K96/N48/bias", (7,), 96, 48, True),
    GemmCase("3d/M33/K128/N80", (3, 11), 128, 80, False),
)
_GEMM_STANDARD = _GEMM_QUICK + (
    GemmCase("M64/K256/N256/bias", (64,), 256, 256, True),
    GemmCase("M5/K40/N24", (5,), 40, 24, False),
    GemmCase("M7/K96/N96/bias/silu_and_mul", (7,), 96, 96, True, silu_and_mul=True),
    GemmCase("3d/M2x9/K64/N128/silu_and_mul", (2, 9), 64, 128, False, silu_and_mul=True),
)
_GEMM_FULL = _GEMM_STANDARD + (
    GemmCase("M512/K1024/N768/bias", (512,), 1024, 768, True),
    GemmCase("3d/M3x7/K4096/N64", (3, 7), 4096, 64, False),
    GemmCase("M300/K512/N1408/bias/silu_and_mul", (300,), 512, 1408, True, silu_and_mul=True),
)
GEMM_CASES: dict[str, tuple[GemmCase, ...]] = {"quick": _GEMM_QUICK, "standard": _GEMM_STANDARD, "full": _GEMM_FULL}


def _gemm_inputs(
    case: GemmCase, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((*case.batch_shape, case.in_features), generator=gen).to(dtype)
    w = (torch.randn((case.out_features, case.in_features), generator=gen) / math.sqrt(case.in_features)).to(dtype)
    b = torch.randn((case.out_features,), generator=gen).to(dtype) if case.bias else None
    return x, w, b


def check_gemm_backend(
    backend: BackendSpec,
    device: str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    registry: PluginRegistry | None = None,
    *,
    cases: str | Sequence[GemmCase] = "standard",
    reference: BackendSpec = "torch",
    tolerances: Tolerances = None,
    seed: int = 0,
) -> ConformanceReport:
    """Run ``linear`` on several shapes (1-3D inputs, with and without bias), with
    the weight as the backend's ``prepare_weight`` leaves it, and
    ``linear_silu_and_mul`` where the backend has it."""
    run = _Run.resolve("gemm", backend, device, dtypes, registry, reference)
    case_list = _cases("gemm", cases, GEMM_CASES)

    def check_one(
        case: GemmCase,
        dtype: torch.dtype,
        query: KernelQuery,
        tol: Tolerance,
        result: CaseResult,
        case_seed: int,
    ) -> None:
        x, w, b = _gemm_inputs(case, dtype, case_seed)
        ref = run.ref_cls(run.reference_query(query))
        expected = ref.linear(_f32(x), _f32(w), _f32(b))
        dev = run.torch_device
        impl = run.cls(query)
        args = (x.to(dev), impl.prepare_weight(w.to(dev)), None if b is None else b.to(dev))
        if not case.silu_and_mul:
            result.passed = _score(result, impl.linear(*args), expected, dtype, tol)
            return
        out = impl.linear_silu_and_mul(*args)
        if out is None:
            run.report.results.remove(result)
            run.report.skipped.append(SkippedCase(case.name, _dtype_name(dtype), ["no fused linear_silu_and_mul"]))
            return
        gate, up = expected.chunk(2, dim=-1)
        result.passed = _score(result, out, F.silu(gate) * up, dtype, tol)

    return run.check_each(case_list, tolerances, seed, check_one)
