"""A Llama served under an architecture name of its own.

Subclassing an in-tree model is the shortest way to a new architecture that
differs from it in a few places: ``radixserve.models.llama`` keeps its variation
points as classmethods (``attention_options``, ``make_mlp``, ``model_facts``) and
its checkpoint names in ``map_weight_name``. A model written from the layers
up follows the same protocol (docs/models.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.models import LlamaForCausalLM, ModelFacts
from radixserve.models.llama import attention_facts

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    #: The config.json ``architectures`` names served by this class.
    architectures = ("ExampleLlamaForCausalLM",)

    @classmethod
    def model_facts(cls, config: PretrainedConfig) -> ModelFacts:
        """What backend selection must know before the model is built: the
        attention's shape and window (and, for a mixture of experts, the experts:
        ``attention_facts(config, num_experts=..., top_k=..., moe_intermediate_size=...)``)."""
        return attention_facts(config)
