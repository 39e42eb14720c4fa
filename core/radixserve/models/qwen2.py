"""Qwen2: Llama with biases on the q/k/v projections (not on o)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.models.llama import AttentionOptions, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen2ForCausalLM",)

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
