"""Model building blocks. Every device-specific computation goes through the
backends in :class:`ModelContext`; the layers own shapes, tensor-parallel
sharding and checkpoint loading."""

from radixserve.layers.attention import PagedAttention
from radixserve.layers.context import ModelContext
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.layer import Layer
from radixserve.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    linear_layers,
)
from radixserve.layers.moe import FusedMoE, MoERouter, SparseMoE, expert_weight_name
from radixserve.layers.norm import GemmaRMSNorm, RMSNorm
from radixserve.layers.rotary import RotaryEmbedding

__all__ = [
    "ColumnParallelLinear",
    "FusedMoE",
    "GemmaRMSNorm",
    "Layer",
    "LinearBase",
    "MergedColumnParallelLinear",
    "ModelContext",
    "MoERouter",
    "PagedAttention",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SparseMoE",
    "VocabParallelEmbedding",
    "expert_weight_name",
    "linear_layers",
]
