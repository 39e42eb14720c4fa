"""An EAGLE head (EAGLE-1 and EAGLE-2's checkpoint layout), the draft of
``--speculative-algorithm eagle``.

An EAGLE head predicts the target model's next feature (its final hidden state,
the LM head's input) from the current one and the token that follows it: for
position ``i`` it reads the target's feature ``f_i`` and the embedding of token
``t_{i+1}``, joins them (``fc`` over ``[embedding, feature]``), runs them
through one Llama decoder layer (the first layer without its input norm) and
reads its output, un-normed, with the target's own LM head; the token it
proposes is that output's argmax, and the output is the feature the next
position reads. The head owns no embedding or LM head: it uses the target's
(``attach``), so a checkpoint's copies of them are not loaded.

The checkpoint is a directory with a Llama ``config.json`` (its
``num_hidden_layers`` the head's layers, usually 1) and safetensors holding
``fc.weight`` (``[hidden, 2 * hidden]``), ``fc.bias`` (if trained with one) and ``layers.N.*`` as
HF's Llama names them (a ``model.`` prefix is taken too).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from radixserve.forward_batch import ForwardBatch
from radixserve.layers import ReplicatedLinear, RotaryEmbedding
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer
from radixserve.layers.weights import load_named_weights
from radixserve.models.base import ModelFacts
from radixserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, attention_facts, fused_weight_name, head_dim_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# What a head checkpoint may hold that the head takes from its target instead.
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight", "norm.weight")


class LlamaEagleHead(Layer):
    architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLMEagle",)
    # Why it cannot be served as the model (it has neither embedding nor LM head of its own).
    serves_only_attached: ClassVar[str] = (
        "an EAGLE head, which drafts for its target model: serve the target with "
        "--speculative-algorithm eagle --speculative-eagle-path set to it"
    )

    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__()
        self.hidden_size = hidden = config.hidden_size
        options = LlamaForCausalLM.attention_options(config)
        rotary_emb = RotaryEmbedding(config, head_dim_of(config), ctx)
        self.fc = ReplicatedLinear(2 * hidden, hidden, ctx, bias=True)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, ctx, options, LlamaForCausalLM.make_mlp(config, i, ctx), rotary_emb)
            for i in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's first layer reads its input un-normed
        self.max_context_len = config.max_position_embeddings
        self._target: tuple[nn.Module, nn.Module] | None = None  # not submodules: the target's weights

    @classmethod
    def model_facts(cls, config: PretrainedConfig) -> ModelFacts:
        return attention_facts(config)

    def attach(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """Use the target model's token embedding and LM head."""
        self._target = (embed_tokens, lm_head)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self._target is None:
            raise RuntimeError("an EAGLE head runs only attached to its target model")
        if batch.input_features is None:
            raise RuntimeError("an EAGLE head reads the target's features: batch.input_features is unset")
        embed_tokens, lm_head = self._target
        embedded = embed_tokens(batch.input_ids)
        hidden = self.fc(torch.cat([embedded, batch.input_features.to(embedded.dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch)
        hidden = hidden + residual
        if batch.capture_hidden:
            batch.hidden_states = hidden
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        logits: torch.Tensor = lm_head(hidden)
        return logits.float()

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        name = name.removeprefix("model.")
        if name in SHARED_WITH_TARGET or name.endswith("rotary_emb.inv_freq"):
            return None
        return fused_weight_name(name, LlamaForCausalLM.stacked_params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, _with_fc_bias(weights, self.hidden_size), self.map_weight_name)


def _with_fc_bias(weights: Iterable[tuple[str, torch.Tensor]], hidden: int) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights``, and a zero ``fc.bias`` after them where the checkpoint has none
    (EAGLE's training code builds ``fc`` with or without one)."""
    has_bias = False
    for name, tensor in weights:
        has_bias = has_bias or name.removeprefix("model.") == "fc.bias"
        yield name, tensor
    if not has_bias:
        yield "fc.bias", torch.zeros(hidden)
