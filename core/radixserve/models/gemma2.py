"""Gemma 2, and the decoder Gemma 3 shares with it (models/gemma3.py).

What Gemma changes in the Llama decoder, each step as HuggingFace computes it
(``modeling_gemma2.py``), so the logits match HF on the same weights:

- the token embedding is multiplied by ``sqrt(hidden_size)`` rounded to the
  model dtype (HF's ``embed_scale.to(dtype)``: 55.4256 becomes 55.5 in bfloat16);
- every RMSNorm is Gemma's (``GemmaRMSNorm``: ``1 + weight``, applied in
  float32 before the cast), four per layer: ``input_layernorm`` and
  ``post_attention_layernorm`` around attention, ``pre_feedforward_layernorm``
  and ``post_feedforward_layernorm`` around the MLP; each block's output is
  normalised before the residual add, which is fused into the next pre-norm;
- the MLP is GeGLU, ``down(gelu_tanh(gate) * up)`` (``gelu_pytorch_tanh``);
- attention scales by ``query_pre_attn_scalar ** -0.5``, soft-caps the scores
  (``attn_logit_softcapping``) and slides a window on the layers ``layer_types``
  marks ``sliding_attention``;
- the logits are soft-capped, ``cap * tanh(logits / cap)``
  (``final_logit_softcapping``), in the model dtype as HF does, then cast to
  float32;
- the LM head is tied to the embedding (``tie_word_embeddings``, the default).

The norms, residual adds, rotary and the activation go through the elementwise
backend, which must have ``gemma_rms_norm`` and ``gelu_tanh_and_mul``
(``ModelFacts.elementwise_ops``); the window and the cap are in the facts, so
selection passes over attention backends without them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from radixserve.forward_batch import ForwardBatch
from radixserve.layers import (
    GemmaRMSNorm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer
from radixserve.models.base import ModelFacts
from radixserve.models.llama import (
    AttentionOptions,
    LlamaAttention,
    LlamaForCausalLM,
    attention_facts,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GEMMA_ELEMENTWISE_OPS = ("gemma_rms_norm", "gelu_tanh_and_mul")


def check_gemma_config(config: PretrainedConfig) -> None:
    """Refuse what the Gemma decoder here does not compute as HF would."""
    act = config.hidden_activation
    if act != "gelu_pytorch_tanh":
        raise NotImplementedError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError("use_bidirectional_attention is not supported (generation is causal)")


class GemmaEmbedding(VocabParallelEmbedding):
    """The token embedding times ``sqrt(hidden_size)``, the factor rounded to the
    model dtype first and the product taken in it, as HF's scaled embedding."""

    embed_scale: torch.Tensor  # a buffer

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ModelContext):
        super().__init__(vocab_size, hidden_size, ctx)
        scale = torch.tensor(hidden_size**0.5, dtype=torch.float32).to(ctx.dtype)
        self.register_buffer("embed_scale", scale, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids).mul_(self.embed_scale)


class GemmaMLP(Layer):
    """GeGLU: gate and up fused into one projection, ``gelu_tanh(gate) * up``
    through the elementwise backend, then down."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx: ModelContext):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], ctx)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, ctx)
        self.act = ctx.elementwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act.gelu_tanh_and_mul(self.gate_up_proj(x)))
        return out


class GemmaDecoderLayer(Layer):
    def __init__(self, config: PretrainedConfig, ctx: ModelContext, attention: LlamaAttention):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attention
        self.mlp = GemmaMLP(hidden, config.intermediate_size, ctx)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, ctx)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, ctx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, ctx)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, ctx)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normalised MLP output, residual stream)``: its add is fused into the
        next layer's input norm (or the final norm). ``residual`` is None for the
        first layer."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, batch))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(Layer):
    def __init__(self, config: PretrainedConfig, ctx: ModelContext, layers: Iterable[nn.Module]):
        super().__init__()
        self.embed_tokens = GemmaEmbedding(config.vocab_size, config.hidden_size, ctx)
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch)
        out: torch.Tensor = self.norm(hidden, residual)[0]
        return out


class Gemma2ForCausalLM(Layer):
    """Gemma 2. Gemma 3 (text) differs in :attr:`qk_norm`,
    :meth:`attention_logit_softcap` and :meth:`rotary_embeddings`."""

    architectures: ClassVar[tuple[str, ...]] = ("Gemma2ForCausalLM",)
    qk_norm: ClassVar[bool] = False

    # The checkpoint names are Llama's (q/k/v and gate/up fused the same way).
    stacked_params = LlamaForCausalLM.stacked_params
    map_weight_name = LlamaForCausalLM.map_weight_name
    load_weights = LlamaForCausalLM.load_weights

    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__()
        check_gemma_config(config)
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        bias = bool(config.attention_bias)
        options = AttentionOptions(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=self.qk_norm,
            norm=GemmaRMSNorm,
            scaling=config.query_pre_attn_scalar**-0.5,
            logit_softcap=self.attention_logit_softcap(config),
        )
        rotary = self.rotary_embeddings(config, ctx)
        layers = (
            GemmaDecoderLayer(config, ctx, LlamaAttention(config, i, ctx, options, rotary[i]))
            for i in range(config.num_hidden_layers)
        )
        self.model = GemmaModel(config, ctx, layers)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.final_logit_softcap: float | None = config.final_logit_softcapping
        self.max_context_len = config.max_position_embeddings

    @classmethod
    def model_facts(cls, config: PretrainedConfig) -> ModelFacts:
        return attention_facts(
            config, logit_softcap=cls.attention_logit_softcap(config), elementwise_ops=GEMMA_ELEMENTWISE_OPS
        )

    @classmethod
    def attention_logit_softcap(cls, config: PretrainedConfig) -> float | None:
        softcap: float | None = config.attn_logit_softcapping
        return softcap

    @classmethod
    def rotary_embeddings(cls, config: PretrainedConfig, ctx: ModelContext) -> list[RotaryEmbedding]:
        """Each layer's rotary embedding: one for all of them."""
        return [RotaryEmbedding(config, head_dim_of(config), ctx)] * config.num_hidden_layers

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        logits: torch.Tensor = self.lm_head(hidden)
        cap = self.final_logit_softcap
        if cap is not None:
            logits = (logits / cap).tanh_().mul_(cap)
        return logits.float()
