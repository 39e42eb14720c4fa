"""Mixtral: Llama (Mistral) attention, and a sparse MoE block in place of every
MLP: softmax over the experts, top-k, the k weights renormalised to sum to one,
each expert a SiLU-gated MLP of ``intermediate_size``.

Checkpoints name the block ``block_sparse_moe`` and an expert's projections
``w1`` (gate), ``w3`` (up) and ``w2`` (down), one tensor per expert (the hub
layout, which transformers 5 also writes); transformers 5's in-memory layout
(``mlp.gate``, stacked ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``)
loads too.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from torch import nn

from radixserve.layers import SparseMoE, expert_weight_name
from radixserve.layers.context import ModelContext
from radixserve.models.base import ModelFacts
from radixserve.models.llama import LlamaForCausalLM, attention_facts

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3)\.(\w+)$")
_PART = {"w1": "gate", "w3": "up", "w2": "down"}


class MixtralForCausalLM(LlamaForCausalLM):
    architectures = ("MixtralForCausalLM",)

    @classmethod
    def model_facts(cls, config: PretrainedConfig) -> ModelFacts:
        return attention_facts(
            config,
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            moe_intermediate_size=config.intermediate_size,
            dense_intermediate_size=0,  # intermediate_size is the experts'
        )

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_id: int, ctx: ModelContext) -> nn.Module:
        return SparseMoE(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            ctx=ctx,
            renormalize=True,
        )

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_weight_name(name, _PER_EXPERT, _PART) or super().map_weight_name(name)
