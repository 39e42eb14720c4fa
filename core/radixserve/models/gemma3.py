"""Gemma 3, text only (HF ``Gemma3ForCausalLM``, config ``gemma3_text``): the
Gemma 2 decoder (models/gemma2.py) with

- a Gemma RMSNorm over each head of q and k before rotary (``q_norm``, ``k_norm``);
- rope per layer type: transformers 5 keeps ``rope_parameters`` keyed by
  ``sliding_attention`` and ``full_attention`` (the local base frequency,
  ``rope_local_base_freq`` in older configs, 10k; the global one 1M, with the
  checkpoint's rope scaling), so each type gets its own cos/sin table;
- no attention soft-cap: HF's Gemma 3 attention passes none, whatever
  ``attn_logit_softcapping`` says (the final logit cap still applies when set).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from radixserve.layers import RotaryEmbedding
from radixserve.layers.context import ModelContext
from radixserve.models.gemma2 import Gemma2ForCausalLM
from radixserve.models.llama import head_dim_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("Gemma3ForCausalLM",)
    qk_norm: ClassVar[bool] = True

    @classmethod
    def attention_logit_softcap(cls, config: PretrainedConfig) -> float | None:
        return None

    @classmethod
    def rotary_embeddings(cls, config: PretrainedConfig, ctx: ModelContext) -> list[RotaryEmbedding]:
        """Each layer's rotary embedding: one per layer type, from that type's rope parameters."""
        params = getattr(config, "rope_parameters", None) or {}
        missing = sorted(set(config.layer_types) - set(params))
        if missing:
            raise NotImplementedError(
                f"Gemma 3 needs rope_parameters per layer type (transformers 5); none for {missing}"
            )
        by_type = {kind: RotaryEmbedding(config, head_dim_of(config), ctx, kind) for kind in set(config.layer_types)}
        return [by_type[kind] for kind in config.layer_types]
