"""Interfaces that backends implement; the core calls kernels only through these."""

from radixserve.kernels.attention import AttentionBackend, AttentionLayerSpec, attention_feature_reasons
from radixserve.kernels.base import Backend
from radixserve.kernels.elementwise import MODEL_SPECIFIC_OPS, ElementwiseBackend, elementwise_op_reasons
from radixserve.kernels.gemm import GemmBackend
from radixserve.kernels.lora import NO_ADAPTER, LoRABackend, LoRABatch, LoRASegment, lora_reference
from radixserve.kernels.mla import MLAAttentionBackend, MLALayerSpec, latent_pool, mla_reasons, up_projected_extend
from radixserve.kernels.moe import MoEBackend, MoERouting, route
from radixserve.kernels.quantization import QuantizationMethod
from radixserve.kernels.query import KernelQuery, QuantizedCheckpoint

__all__ = [
    "AttentionBackend",
    "AttentionLayerSpec",
    "Backend",
    "ElementwiseBackend",
    "GemmBackend",
    "KernelQuery",
    "LoRABackend",
    "LoRABatch",
    "LoRASegment",
    "NO_ADAPTER",
    "QuantizedCheckpoint",
    "MLAAttentionBackend",
    "MLALayerSpec",
    "MODEL_SPECIFIC_OPS",
    "MoEBackend",
    "MoERouting",
    "QuantizationMethod",
    "attention_feature_reasons",
    "elementwise_op_reasons",
    "latent_pool",
    "lora_reference",
    "mla_reasons",
    "route",
    "up_projected_extend",
]
