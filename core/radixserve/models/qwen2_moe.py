"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases when
``qkv_bias``, the default) and Qwen3-MoE's layer plan and expert checkpoint
names; each sparse block adds a **shared expert**, a SiLU-gated MLP of
``shared_expert_intermediate_size`` that every token passes through, scaled by
its own gate: ``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``.
The top-k weights are renormalised only with ``norm_topk_prob`` (default off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers import MoERouter
from radixserve.layers.context import ModelContext
from radixserve.models.llama import AttentionOptions, LlamaMLP
from radixserve.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseBlock

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2MoeSparseBlock(Qwen3MoeSparseBlock):
    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__(config, ctx)
        self.shared_expert = LlamaMLP(config.hidden_size, config.shared_expert_intermediate_size, ctx)
        # One output per token, replicated on every rank like the router (never quantized).
        self.shared_expert_gate = MoERouter(config.hidden_size, 1, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out: torch.Tensor = self.experts(x, self.gate(x)) + shared
        return out


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    architectures = ("Qwen2MoeForCausalLM",)

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False)

    @classmethod
    def sparse_block(cls, config: PretrainedConfig, ctx: ModelContext) -> nn.Module:
        return Qwen2MoeSparseBlock(config, ctx)

    @classmethod
    def shared_mlp_size(cls, config: PretrainedConfig) -> int:
        size: int = config.shared_expert_intermediate_size
        return size
