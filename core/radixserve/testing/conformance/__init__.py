"""The conformance kit: check any backend against the torch reference in one call.

    from radixserve.testing import check_attention_backend
    check_attention_backend("mybackend", device="cuda").raise_for_failures()

Each ``check_*`` function builds the contract's cases (random paged KV layouts
with permuted slots, page sizes 1 and 16, ragged batches, cached prefixes,
decode, GQA, head dims 64 and 128; several MoE expert counts, top-k,
renormalization and group-limited routing settings; GEMM shapes with and without bias; the quantization
lifecycle; KV transfer between pools of different page sizes, layouts and
tensor-parallel splits, and its refusals; batched LoRA updates over interleaved adapter slots with the
base model's rows left untouched; RMSNorm with and without the fused residual, rotary NeoX/GPT-J/partial
on views of a fused QKV buffer, SiLU-and-mul), runs the backend on ``device`` for every dtype it claims (asked
through ``unsupported_reasons``) and compares it with the reference backend run
on CPU in float32 on the same (dtype-rounded) inputs. The reference is the
``torch`` plugin's: ``torch_native`` attention, MoE and elementwise, ``torch`` GEMM, resolved
by name through the registry like any backend (LoRA's is the contract's ``lora_reference``, in float64).

A backend may decline a case or a dtype (``unsupported_reasons``): the report
lists it under ``skipped``, and ``num_run`` counts the (case, dtype) pairs that
ran; ``raise_for_failures(min_run=N)`` also fails when fewer than N ran.

A case passes when every element satisfies ``|out - ref| <= atol + rtol * |ref|``
with the dtype's tolerance (``DEFAULT_TOLERANCES``, overridable). The report
shows ``max_abs = max |out - ref|`` and ``max_rel = max_abs / max |ref|`` per case.
Attention cases also check the KV store: after ``forward`` the pool must hold
exactly the new K/V (in the pool dtype) at ``out_cache_loc`` and be unchanged
everywhere else, in every layer.

Case sets: ``"quick"`` (a few cases, for slow backends such as the Triton
interpreter), ``"standard"`` (the default), ``"full"`` (more shapes, for real
devices), or an explicit sequence of case objects.

Layout (as radixserve.kernels): ``base`` holds the tolerances, results, report,
``compare`` and the shared driver; ``attention``, ``mla``, ``moe``, ``lora``, ``gemm``,
``elementwise``, ``quantization`` and ``kv_transfer`` hold each kind's case sets, reference
checks and ``check_*`` function. The case classes and the functions that make a
case's inputs (``AttentionCase``, ``make_attention_inputs``, ``with_kv_layout``,
``MLACase``, ``make_mla_inputs``, ``ElementwiseCase``,
``make_elementwise_inputs``, ``run_elementwise_case``, ``MoECase``,
``make_moe_inputs``, ``LoRACase``, ``make_lora_inputs``) live beside the kernel interfaces, in
``radixserve.kernels.cases``, where ``auto``'s timing uses them too; they are
re-exported here. Import from this package; the names below are its API.
"""

from radixserve.kernels.cases import (
    ELEMENTWISE_OPS,  # noqa: F401  (public names outside __all__, importable from here as before)
    AttentionCase,
    AttentionInputs,
    ElementwiseCase,
    LoRACase,
    MLACase,
    MLAInputs,
    MoECase,
    make_attention_inputs,
    make_elementwise_inputs,
    make_lora_inputs,
    make_mla_inputs,
    make_moe_inputs,
    run_elementwise_case,
    with_kv_layout,
)
from radixserve.testing.conformance.attention import ATTENTION_CASES, check_attention_backend, dense_attention
from radixserve.testing.conformance.base import (
    DEFAULT_DTYPES,
    DEFAULT_TOLERANCES,
    BackendSpec,  # noqa: F401  (public names outside __all__, importable from here as before)
    CaseBody,  # noqa: F401
    CaseResult,
    ConformanceReport,
    SkippedCase,
    Tolerance,
    Tolerances,  # noqa: F401
    compare,
    resolve_backend,
)
from radixserve.testing.conformance.elementwise import ELEMENTWISE_CASES, check_elementwise_backend
from radixserve.testing.conformance.gemm import GEMM_CASES, GemmCase, check_gemm_backend
from radixserve.testing.conformance.kv_transfer import (
    KV_TRANSFER_CASES,
    PoolSpec,
    TransferCase,
    check_kv_transfer_backend,
)
from radixserve.testing.conformance.lora import LORA_CASES, check_lora_backend
from radixserve.testing.conformance.mla import MLA_CASES, check_mla_attention_backend, dense_mla_attention
from radixserve.testing.conformance.moe import MOE_CASES, check_moe_backend
from radixserve.testing.conformance.quantization import (
    QUANT_CASES,
    QUANT_REFERENCES,
    QuantCase,
    QuantReference,  # noqa: F401
    check_quantization_method,
)
from radixserve.testing.conformance.speculative import check_proposer

__all__ = [
    "ATTENTION_CASES",
    "AttentionCase",
    "AttentionInputs",
    "CaseResult",
    "ConformanceReport",
    "DEFAULT_DTYPES",
    "DEFAULT_TOLERANCES",
    "ELEMENTWISE_CASES",
    "ElementwiseCase",
    "GEMM_CASES",
    "GemmCase",
    "KV_TRANSFER_CASES",
    "LORA_CASES",
    "LoRACase",
    "MLACase",
    "MLAInputs",
    "MLA_CASES",
    "MOE_CASES",
    "MoECase",
    "PoolSpec",
    "QUANT_CASES",
    "QUANT_REFERENCES",
    "QuantCase",
    "SkippedCase",
    "Tolerance",
    "TransferCase",
    "check_attention_backend",
    "check_elementwise_backend",
    "check_gemm_backend",
    "check_kv_transfer_backend",
    "check_lora_backend",
    "check_proposer",
    "check_mla_attention_backend",
    "check_moe_backend",
    "check_quantization_method",
    "compare",
    "dense_attention",
    "dense_mla_attention",
    "make_attention_inputs",
    "make_elementwise_inputs",
    "make_lora_inputs",
    "make_mla_inputs",
    "make_moe_inputs",
    "resolve_backend",
    "run_elementwise_case",
    "with_kv_layout",
]
