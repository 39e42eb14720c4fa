"""Qwen3-MoE: Qwen3 attention; layer ``i`` is sparse unless it is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``, exactly as in HF.

Checkpoints store experts either per expert (``experts.{e}.gate_proj.weight``,
the hub layout, which transformers 5 also writes) or stacked
(``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``,
transformers 5's in-memory layout); both load.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from torch import nn

from radixserve.layers import SparseMoE, expert_weight_name
from radixserve.layers.context import ModelContext
from radixserve.models.base import ModelFacts
from radixserve.models.llama import LlamaMLP, attention_facts
from radixserve.models.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def num_experts_of(config: PretrainedConfig) -> int:
    num_experts: int | None = getattr(config, "num_experts", None)
    if not num_experts:  # Mixtral's name
        num_experts = getattr(config, "num_local_experts", 0)
    return num_experts


class Qwen3MoeSparseBlock(SparseMoE):
    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__(
            num_experts=num_experts_of(config),
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            ctx=ctx,
            renormalize=bool(config.norm_topk_prob),
        )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Subclasses change the sparse block (:meth:`sparse_block`)."""

    architectures = ("Qwen3MoeForCausalLM",)

    @classmethod
    def model_facts(cls, config: PretrainedConfig) -> ModelFacts:
        layers = config.num_hidden_layers
        sparse = sum(cls.is_sparse_layer(config, i) for i in range(layers))
        return attention_facts(
            config,
            num_experts=num_experts_of(config),
            top_k=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            dense_intermediate_size=config.intermediate_size if 2 * sparse < layers else cls.shared_mlp_size(config),
        )

    @classmethod
    def shared_mlp_size(cls, config: PretrainedConfig) -> int:
        """The intermediate size of the dense MLP beside the experts of a sparse layer (0: none)."""
        return 0

    @classmethod
    def is_sparse_layer(cls, config: PretrainedConfig, layer_id: int) -> bool:
        return (
            layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and num_experts_of(config) > 0
            and (layer_id + 1) % getattr(config, "decoder_sparse_step", 1) == 0
        )

    @classmethod
    def sparse_block(cls, config: PretrainedConfig, ctx: ModelContext) -> nn.Module:
        return Qwen3MoeSparseBlock(config, ctx)

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_id: int, ctx: ModelContext) -> nn.Module:
        if cls.is_sparse_layer(config, layer_id):
            return cls.sparse_block(config, ctx)
        return LlamaMLP(config.hidden_size, config.intermediate_size, ctx)

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        return expert_weight_name(name, _PER_EXPERT, _PART) or super().map_weight_name(name)
