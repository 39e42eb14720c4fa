"""EAGLE heads, the drafts of ``--speculative-algorithm eagle``: EAGLE-1/2's
checkpoint layout (``LlamaEagleHead``) and EAGLE-3's (``LlamaEagle3Head``).

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

An EAGLE-3 head reads more of the target and less of its vocabulary. Its feature
of position ``i`` is three of the target's layers' outputs side by side (the
layers its config's ``eagle_config.eagle_aux_hidden_state_layer_ids`` names; by
default ``1``, ``L/2 - 1`` and ``L - 4`` of ``L``), which ``fc`` maps to the
hidden size (``read_target_features``). Its one decoder layer reads the normed
embedding of token ``i + 1`` and the normed feature side by side (the attention's
projections are twice as wide), with the feature as the residual; the output
(before the final norm) is the feature the next drafted position reads, and the
normed output gives logits over a draft vocabulary of its own (``lm_head``, the
target's most frequent tokens; ``d2t[j]`` is what to add to draft token ``j`` to
get the target's). The logits it returns are over the target's vocabulary, every
token outside the draft vocabulary at minus infinity, so the proposer (which drafts
their argmax) and the verifier take its proposals as any draft's. Its checkpoint (config
architecture ``LlamaForCausalLMEagle3``) holds ``fc.weight``, ``midlayer.*``
(with ``hidden_norm``), ``norm.weight``, ``lm_head.weight``, ``d2t`` and ``t2d``;
the head uses the target's token embedding, so an ``embed_tokens.weight`` is not read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from radixserve.forward_batch import ForwardBatch
from radixserve.layers import ParallelLMHead, ReplicatedLinear, RMSNorm, RotaryEmbedding
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer
from radixserve.layers.weights import CheckpointTensor, load_named_weights
from radixserve.models.base import ModelFacts
from radixserve.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    attention_facts,
    fused_weight_name,
    head_dim_of,
)

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

    @staticmethod
    def target_layers(config: PretrainedConfig, target_layers: int) -> tuple[int, ...]:
        """The target's layers whose outputs the head reads (none: its final hidden state)."""
        return ()

    def attach(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """Use the target model's token embedding and LM head."""
        self._target = (embed_tokens, lm_head)

    def read_target_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as the head's positions read them (as they come)."""
        return features

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


# What an EAGLE-3 checkpoint holds that the head does not read: the target's embedding
# (the head uses the target's) and the target-to-draft token mask (``d2t`` says it all).
EAGLE3_UNREAD = ("embed_tokens.weight", "t2d")


class Eagle3DecoderLayer(Layer):
    """EAGLE-3's decoder layer: attention over the normed token embedding and the
    normed feature side by side, the feature as the residual; then Llama's MLP block."""

    def __init__(self, config: PretrainedConfig, ctx: ModelContext, rotary_emb: RotaryEmbedding):
        super().__init__()
        hidden = config.hidden_size
        options = LlamaForCausalLM.attention_options(config)
        self.self_attn = LlamaAttention(config, 0, ctx, options, rotary_emb, input_size=2 * hidden)
        self.mlp = LlamaForCausalLM.make_mlp(config, 0, ctx)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, ctx)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, ctx)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, ctx)

    def forward(
        self, embedded: torch.Tensor, features: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``, whose sum is the layer's output."""
        joined = torch.cat([self.input_layernorm(embedded), self.hidden_norm(features)], dim=-1)
        hidden, residual = self.post_attention_layernorm(self.self_attn(joined, batch), features)
        return self.mlp(hidden), residual


class LlamaEagle3Head(Layer):
    architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLMEagle3",)
    serves_only_attached: ClassVar[str] = LlamaEagleHead.serves_only_attached
    target_token_ids: torch.Tensor

    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__()
        check_eagle3_config(config)
        hidden = config.hidden_size
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = draft_vocab_size(config)
        self.fc = ReplicatedLinear(3 * hidden, hidden, ctx, bias=bool(getattr(config, "bias", False)))
        self.midlayer = Eagle3DecoderLayer(config, ctx, RotaryEmbedding(config, head_dim_of(config), ctx))
        self.norm = RMSNorm(hidden, config.rms_norm_eps, ctx)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden, ctx)
        # The target's token id of each draft token (the checkpoint's ``d2t`` plus the draft id).
        self.register_buffer("target_token_ids", torch.arange(self.draft_vocab_size), persistent=False)
        self.max_context_len = config.max_position_embeddings
        self._embed_tokens: nn.Module | None = None  # not a submodule: the target's weights

    @classmethod
    def model_facts(cls, config: PretrainedConfig) -> ModelFacts:
        return attention_facts(config)

    @staticmethod
    def target_layers(config: PretrainedConfig, target_layers: int) -> tuple[int, ...]:
        """The three layers whose outputs the head reads: its config's
        ``eagle_config.eagle_aux_hidden_state_layer_ids``, else EAGLE-3's default."""
        eagle_config = getattr(config, "eagle_config", None) or {}
        layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if layer_ids is None:
            layer_ids = [1, target_layers // 2 - 1, target_layers - 4]
        if len(layer_ids) != 3 or any(not 0 <= i < target_layers for i in layer_ids):
            raise ValueError(
                f"speculative_eagle_path: eagle_config.eagle_aux_hidden_state_layer_ids is {list(layer_ids)} "
                f"(by default 1, L/2 - 1 and L - 4): an EAGLE-3 head reads three of the target's "
                f"{target_layers} layers"
            )
        return tuple(layer_ids)

    def attach(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """Use the target model's token embedding (the head has its own LM head)."""
        self._embed_tokens = embed_tokens

    def read_target_features(self, features: torch.Tensor) -> torch.Tensor:
        """Three layers' outputs -> the hidden size."""
        out: torch.Tensor = self.fc(features)
        return out

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self._embed_tokens is None:
            raise RuntimeError("an EAGLE head runs only attached to its target model")
        if batch.input_features is None:
            raise RuntimeError("an EAGLE head reads the target's features: batch.input_features is unset")
        embedded = self._embed_tokens(batch.input_ids)
        hidden, residual = self.midlayer(embedded, batch.input_features.to(embedded.dtype), batch)
        normed, output = self.norm(hidden, residual)
        if batch.capture_hidden:
            batch.hidden_states = output
        if batch.logits_indices is not None:
            normed = normed[batch.logits_indices]
        draft_logits: torch.Tensor = self.lm_head(normed).float()
        if self.draft_vocab_size == self.vocab_size:
            return draft_logits
        logits = draft_logits.new_full((len(draft_logits), self.vocab_size), float("-inf"))
        logits[:, self.target_token_ids] = draft_logits
        return logits

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        name = name.removeprefix("model.")
        if name in EAGLE3_UNREAD or name.endswith("rotary_emb.inv_freq"):
            return None
        return fused_weight_name(name, LlamaForCausalLM.stacked_params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, self._take_token_map(weights), self.map_weight_name)

    def _take_token_map(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """``weights`` but ``d2t``, which sets ``target_token_ids``."""
        found = False
        for name, tensor in weights:
            if name.removeprefix("model.") != "d2t":
                yield name, tensor
                continue
            if tensor.shape != (self.draft_vocab_size,):
                raise ValueError(f"d2t has shape {tuple(tensor.shape)}; draft_vocab_size is {self.draft_vocab_size}")
            loaded = tensor.load() if isinstance(tensor, CheckpointTensor) else tensor
            ids = loaded.to(torch.int64) + torch.arange(self.draft_vocab_size)
            if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
                raise ValueError(f"d2t maps draft tokens outside the target's {self.vocab_size}-token vocabulary")
            self.target_token_ids.copy_(ids)
            found = True
        if not found and self.draft_vocab_size != self.vocab_size:
            raise ValueError(
                f"the EAGLE-3 head's draft vocabulary has {self.draft_vocab_size} tokens "
                f"(draft_vocab_size) but its checkpoint has no d2t to map them to the target's"
            )


def draft_vocab_size(config: PretrainedConfig) -> int:
    size: int = getattr(config, "draft_vocab_size", None) or config.vocab_size
    return size


def check_eagle3_config(config: PretrainedConfig) -> None:
    """What an EAGLE-3 head's config may say that radixserve does not serve, named."""
    hidden = config.hidden_size
    target_hidden = getattr(config, "target_hidden_size", None) or hidden
    if target_hidden != hidden:
        raise ValueError(
            f"speculative_eagle_path: target_hidden_size is {target_hidden} and hidden_size {hidden}; "
            f"an EAGLE-3 head here shares its target's embedding, so they must be equal"
        )
    if config.num_hidden_layers != 1:
        raise ValueError(
            f"speculative_eagle_path: num_hidden_layers is {config.num_hidden_layers}; an EAGLE-3 head has 1"
        )
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(
            "speculative_eagle_path: tie_word_embeddings is true; an EAGLE-3 head served here has an lm_head of its own"
        )
    if not 0 < draft_vocab_size(config) <= config.vocab_size:
        raise ValueError(
            f"speculative_eagle_path: draft_vocab_size is {draft_vocab_size(config)}, "
            f"the vocabulary {config.vocab_size}"
        )
