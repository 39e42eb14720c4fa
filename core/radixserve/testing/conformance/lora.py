"""The LoRA kit: ``LoRACase``'s case sets and ``check_lora_backend``. The case
class and ``make_lora_inputs`` live in radixserve/kernels/cases/lora.py, which
``auto``'s timing uses too.

The reference is the contract's own statement, ``lora_reference`` (float64, on
the dtype-rounded inputs), not a backend: each segment's rows of ``out`` gain
their update, and everything else (the base model's rows, ``x``, ``a``, ``b``)
stays bit for bit as it was. The default tolerances hold whether a kernel keeps
the shrink's ``[T, K]`` intermediate in float32 or rounds it to the model dtype
(as PEFT and ``torch_native`` do): the update is scaled to about the size of
``out``, so one more rounding of it stays well inside them.

Fused cases split ``out`` unequally for q/k/v (``(q, kv, kv)``, q = 2 kv, the
boundaries inside a 64-column block), so a kernel that gives a projection the
wrong rank columns, the wrong rows of ``b`` or equal-sized splits fails them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from radixserve.kernels import NO_ADAPTER, KernelQuery, LoRABatch, lora_reference
from radixserve.kernels.cases.lora import LoRACase, make_lora_inputs
from radixserve.testing.conformance.base import (
    BackendSpec,
    CaseResult,
    ConformanceReport,
    Tolerance,
    Tolerances,
    _cases,
    _Run,
    _score,
    resolve_backend,
)

if TYPE_CHECKING:
    from radixserve.registry import PluginRegistry

_N = NO_ADAPTER
_LORA_QUICK = (
    LoRACase("one-segment/T13", (13,), (0,), 64, 96, 16, 2),
    LoRACase("decode/interleaved/bs6", (1,) * 6, (0, 1, 2, 0, 1, 2), 64, 80, 8, 3),
    # a fused q/k/v of rank 8 (K = 24, not a power of two), out split (72, 36, 36), beside the base model's requests
    LoRACase("prefill/base-mixed/qkv-K24", (5, 7, 3, 4), (1, _N, 1, _N), 72, 144, 8, 2, fused=3),
)
_LORA_STANDARD = _LORA_QUICK + (
    LoRACase("base-only", (4, 3), (_N, _N), 64, 64, 8, 2),
    LoRACase("empty/T0", (), (), 64, 64, 8, 2),
    LoRACase("decode/base-mixed/slots-3-to-5", (1,) * 8, (3, _N, 5, 3, _N, _N, 4, 5), 48, 56, 16, 6),
    # neighbouring requests of slot 2 make one run; K = 48, out split (60, 30, 30)
    LoRACase("prefill/runs-merge/qkv-K48", (6, 2, 9), (2, 2, 0), 64, 120, 16, 3, fused=3),
    # rank 12 (a rank tile of 16, masked) on q/k/v split (50, 25, 25), decode of interleaved adapters
    LoRACase("decode/interleaved/qkv-r12", (1,) * 5, (0, 2, 1, 0, 2), 40, 100, 12, 3, fused=3),
    # a run longer than a 64-token block, in_features over several blocks, rank 12
    LoRACase("prefill/long-run/T70/r12", (70, 3), (1, 0), 200, 72, 12, 2),
    LoRACase("mixed/decode+prefill/gate_up-K32", (17, 1, 1, 33, 1), (4, 0, _N, 2, 4), 80, 112, 16, 5, fused=2),
)
_LORA_FULL = _LORA_STANDARD + (
    # q/k/v as Llama 3 8B's: 32 query heads, 8 KV heads of 128
    LoRACase(
        "full/decode/bs64/8-slots/qkv",
        (1,) * 64,
        tuple(i % 8 for i in range(64)),
        4096,
        6144,
        16,
        8,
        fused=3,
        out_splits=(4096, 1024, 1024),
    ),
    LoRACase(
        "full/prefill/qkv-r64", (300, 212, 1), (3, _N, 0), 4096, 6144, 64, 4, fused=3, out_splits=(4096, 1024, 1024)
    ),
    LoRACase("full/gate_up-r32", (129, 1, 1, 255), (0, 1, _N, 7), 4096, 28672, 32, 8, fused=2),
    LoRACase("full/down-r64", (513,), (2,), 14336, 4096, 64, 4),
)
LORA_CASES: dict[str, tuple[LoRACase, ...]] = {"quick": _LORA_QUICK, "standard": _LORA_STANDARD, "full": _LORA_FULL}


def check_lora_backend(
    backend: BackendSpec,
    device: str = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    registry: PluginRegistry | None = None,
    *,
    cases: str | Sequence[LoRACase] = "standard",
    tolerances: Tolerances = None,
    seed: int = 0,
) -> ConformanceReport:
    """Run the LoRA cases (one run, interleaved adapters, base-model requests among
    them, no adapter at all, slots not from 0, K not a power of two) on ``backend``."""
    name, cls = resolve_backend("lora", backend, registry)
    run = _Run("lora", name, cls, "lora_reference (float64)", None, device, dtypes, registry)
    case_list = _cases("lora", cases, LORA_CASES)

    def check_one(
        case: LoRACase,
        dtype: torch.dtype,
        query: KernelQuery,
        tol: Tolerance,
        result: CaseResult,
        case_seed: int,
    ) -> None:
        x, out, a, b, batch, out_splits = make_lora_inputs(case, dtype, run.torch_device, seed=case_seed)
        x0, out0, a0, b0 = (t.to("cpu", copy=True) for t in (x, out, a, b))
        expected = out0.double() + lora_reference(x0, a0, b0, batch, out_splits)
        run.cls(query).apply(x, out, a, b, batch, out_splits)
        result.passed = _score(result, out, expected, dtype, tol)
        problems = _untouched(out, out0, batch) + [
            f"{label} was changed"
            for label, t, t0 in (("x", x, x0), ("a", a, a0), ("b", b, b0))
            if not t.cpu().equal(t0)
        ]
        if problems:
            result.error = "; ".join([result.error, *problems] if result.error else problems)
            result.passed = False

    return run.check_each(case_list, tolerances, seed, check_one)


def _untouched(out: torch.Tensor, before: torch.Tensor, batch: LoRABatch) -> list[str]:
    """What is wrong with the rows in no segment (the base model's): they must be bit for bit as before."""
    base = torch.ones(batch.num_tokens, dtype=torch.bool)
    for seg in batch.segments:
        base[seg.start : seg.start + seg.length] = False
    changed = (base & (out.cpu() != before).any(dim=1)).nonzero().flatten().tolist()
    if not changed:
        return []
    return [f"{len(changed)} base-model rows changed (tokens {changed[:8]}{' ...' if len(changed) > 8 else ''})"]
