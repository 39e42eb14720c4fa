"""The MoE kit: ``MoECase``'s case sets and ``check_moe_backend``. The case
class and ``make_moe_inputs`` (tie-free router logits) live in
radixserve/kernels/cases/moe.py, which ``auto``'s timing uses too."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from radixserve.kernels import KernelQuery
from radixserve.kernels.cases.moe import MoECase, make_moe_inputs
from radixserve.testing.conformance.base import (
    BackendSpec,
    CaseResult,
    ConformanceReport,
    Tolerance,
    Tolerances,
    _cases,
    _f32,
    _Run,
    _score,
)

if TYPE_CHECKING:
    from radixserve.registry import PluginRegistry

_MOE_QUICK = (
    MoECase("E8/k2/renorm/T13", 13, 64, 96, 8, 2, True),
    MoECase("E8/k2/plain/T7", 7, 64, 96, 8, 2, False),
    MoECase("E4/k1/plain/T1", 1, 48, 80, 4, 1, False),
)
_MOE_STANDARD = _MOE_QUICK + (
    MoECase("E16/k4/renorm/T32", 32, 128, 64, 16, 4, True),
    MoECase("E4/k4/all-experts/T5", 5, 80, 56, 4, 4, False),
    MoECase("E8/k1/renorm/T9", 9, 64, 128, 8, 1, True),
    # DeepSeek-V2's group-limited routing: 4 groups of 4 experts, the best 2 groups compete, weights x 2.5.
    MoECase(
        "E16/k3/plain/groups4-top2/x2.5/T11", 11, 64, 96, 16, 3, False, num_groups=4, topk_groups=2, scaling_factor=2.5
    ),
)
_MOE_FULL = _MOE_STANDARD + (
    MoECase("E64/k6/renorm/T200", 200, 256, 192, 64, 6, True),
    MoECase("E32/k8/plain/T77", 77, 512, 320, 32, 8, False),
)
MOE_CASES: dict[str, tuple[MoECase, ...]] = {"quick": _MOE_QUICK, "standard": _MOE_STANDARD, "full": _MOE_FULL}


def check_moe_backend(
    backend: BackendSpec,
    device: str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    registry: PluginRegistry | None = None,
    *,
    cases: str | Sequence[MoECase] = "standard",
    reference: BackendSpec = "torch_native",
    tolerances: Tolerances = None,
    seed: int = 0,
) -> ConformanceReport:
    """Run the MoE cases (expert counts, top-k, renormalization) on ``backend``."""
    run = _Run.resolve("moe", backend, device, dtypes, registry, reference)
    case_list = _cases("moe", cases, MOE_CASES)

    def check_one(
        case: MoECase,
        dtype: torch.dtype,
        query: KernelQuery,
        tol: Tolerance,
        result: CaseResult,
        case_seed: int,
    ) -> None:
        hidden, logits, w13, w2, routing = make_moe_inputs(case, dtype, seed=case_seed)
        ref = run.ref_cls(run.reference_query(query))
        expected = ref.forward(_f32(hidden), _f32(logits), _f32(w13), _f32(w2), routing)
        dev = run.torch_device
        impl = run.cls(query)
        out = impl.forward(hidden.to(dev), logits.to(dev), w13.to(dev), w2.to(dev), routing)
        result.passed = _score(result, out, expected, dtype, tol)

    return run.check_each(case_list, tolerances, seed, check_one)
