"""Testing helpers for radixserve and its plugins.

The conformance kit checks a backend against the torch reference in one call::

    from radixserve.testing import check_attention_backend
    check_attention_backend("mybackend", device="cuda").raise_for_failures()
"""

from radixserve.testing.conformance import (
    ATTENTION_CASES,
    DEFAULT_TOLERANCES,
    ELEMENTWISE_CASES,
    GEMM_CASES,
    MLA_CASES,
    MOE_CASES,
    QUANT_CASES,
    AttentionCase,
    ConformanceReport,
    ElementwiseCase,
    GemmCase,
    MLACase,
    MoECase,
    QuantCase,
    Tolerance,
    check_attention_backend,
    check_elementwise_backend,
    check_gemm_backend,
    check_kv_transfer_backend,
    check_mla_attention_backend,
    check_moe_backend,
    check_proposer,
    check_quantization_method,
    dense_attention,
    dense_mla_attention,
    make_attention_inputs,
    make_mla_inputs,
)

__all__ = [
    "ATTENTION_CASES",
    "DEFAULT_TOLERANCES",
    "ELEMENTWISE_CASES",
    "GEMM_CASES",
    "MLA_CASES",
    "MOE_CASES",
    "QUANT_CASES",
    "AttentionCase",
    "ConformanceReport",
    "ElementwiseCase",
    "GemmCase",
    "MLACase",
    "MoECase",
    "QuantCase",
    "Tolerance",
    "check_attention_backend",
    "check_elementwise_backend",
    "check_gemm_backend",
    "check_kv_transfer_backend",
    "check_proposer",
    "check_mla_attention_backend",
    "check_moe_backend",
    "check_quantization_method",
    "dense_attention",
    "dense_mla_attention",
    "make_attention_inputs",
    "make_mla_inputs",
]
