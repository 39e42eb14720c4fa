"""Qwen3-MoE: Qwen3 attention; layer ``i`` is sparse unless it is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``, exactly as in HF.

Checkpoints store experts either per expert (``experts.{e}.gate_proj.weight``,
the hub layout, which transformers 5 also writes) or stacked
(``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``,
transformers 5's in-memory layout); both load.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from radixserve.layers import FusedMoE, MoERouter
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer
from radixserve.models.base import ModelFacts
from radixserve.models.llama import LlamaMLP, attention_facts
from radixserve.models.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = {"experts.gate_up_proj": "experts.w13_weight", "experts.down_proj": "experts.w2_weight"}
_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def num_experts_of(config: "PretrainedConfig") -> int:
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)


class Qwen3MoeSparseBlock(Layer):
    def __init__(self, config: "PretrainedConfig", ctx: ModelContext):
        super().__init__()
        num_experts = num_experts_of(config)
        self.gate = MoERouter(config.hidden_size, num_experts, ctx)
        self.experts = FusedMoE(
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            ctx=ctx,
            renormalize=bool(config.norm_topk_prob),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    architectures = ("Qwen3MoeForCausalLM",)

    @classmethod
    def model_facts(cls, config: "PretrainedConfig") -> ModelFacts:
        return attention_facts(config, num_experts=num_experts_of(config), top_k=config.num_experts_per_tok)

    @classmethod
    def make_mlp(cls, config: "PretrainedConfig", layer_id: int, ctx: ModelContext) -> nn.Module:
        sparse = (
            layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and num_experts_of(config) > 0
            and (layer_id + 1) % getattr(config, "decoder_sparse_step", 1) == 0
        )
        if sparse:
            return Qwen3MoeSparseBlock(config, ctx)
        return LlamaMLP(config.hidden_size, config.intermediate_size, ctx)

    def map_weight_name(self, name: str) -> Optional[tuple[str, Any]]:
        match = _PER_EXPERT.search(name)
        if match:
            expert, proj = int(match.group(1)), match.group(2)
            param = "experts.w2_weight" if proj == "down_proj" else "experts.w13_weight"
            return f"{name[: match.start()]}.{param}", (expert, _PART[proj])
        for suffix, param in _STACKED.items():
            if name.endswith("." + suffix):
                return name[: -len(suffix)] + param, None
        return super().map_weight_name(name)
