"""The cases kernels are run on, beside the interfaces they exercise: each
kind's case class and the function that makes a case's input tensors (seeded,
on CPU, then put on the device), and for elementwise ops the one call of an op
with its contract checked.

Two users share them: ``auto``'s selection by measurement
(``radixserve.backend_timing``), which times the candidates on cases of the
model's own shapes, and the conformance kit (``radixserve.testing.conformance``),
which builds its case sets from them and compares every backend with the torch
reference on the inputs they make. The kit re-exports these names, so
``from radixserve.testing.conformance import AttentionCase`` still works; the
serving path imports them from here and never imports ``radixserve.testing``.

Layout (as radixserve.kernels): ``attention`` (``AttentionCase``,
``AttentionInputs``, ``make_attention_inputs``, ``with_kv_layout``), ``mla``
(``MLACase``, ``MLAInputs``, ``make_mla_inputs``), ``elementwise``
(``ElementwiseCase``, ``ELEMENTWISE_OPS``, ``make_elementwise_inputs``,
``run_elementwise_case``), ``moe`` (``MoECase``, ``make_moe_inputs``) and
``lora`` (``LoRACase``, ``make_lora_inputs``). GEMM has no case class here:
``auto`` times its projections on plain tensors.
"""

from radixserve.kernels.cases.attention import AttentionCase, AttentionInputs, make_attention_inputs, with_kv_layout
from radixserve.kernels.cases.elementwise import (
    ELEMENTWISE_OPS,
    ElementwiseCase,
    make_elementwise_inputs,
    run_elementwise_case,
)
from radixserve.kernels.cases.lora import LoRACase, make_lora_inputs
from radixserve.kernels.cases.mla import MLACase, MLAInputs, make_mla_inputs
from radixserve.kernels.cases.moe import MoECase, make_moe_inputs

__all__ = [
    "ELEMENTWISE_OPS",
    "AttentionCase",
    "AttentionInputs",
    "ElementwiseCase",
    "LoRACase",
    "MLACase",
    "MLAInputs",
    "MoECase",
    "make_attention_inputs",
    "make_elementwise_inputs",
    "make_lora_inputs",
    "make_mla_inputs",
    "make_moe_inputs",
    "run_elementwise_case",
    "with_kv_layout",
]
