"""Qwen3: Llama with a per-head RMSNorm on q and k and an explicit head_dim."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.models.llama import AttentionOptions, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen3ForCausalLM",)

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
