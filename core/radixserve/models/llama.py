"""The Llama-family decoder: Llama 2/3/3.1 and Mistral. Qwen2, Qwen3 and
Qwen3-MoE are small subclasses that change the attention options or the MLP.

Numerics follow HuggingFace's modeling code step by step (residual adds in the
model dtype, RMSNorm in float32, rotary cos/sin cast to the model dtype), so the
logits match HF on the same weights. The norms, the residual adds (fused into
the norm that follows them), rotary and the MLP activation run through the
elementwise backend (``ctx.elementwise``), so a plugin's kernels serve them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from radixserve.forward_batch import ForwardBatch
from radixserve.layers import (
    MergedColumnParallelLinear,
    PagedAttention,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer
from radixserve.layers.weights import load_named_weights
from radixserve.models.base import ModelFacts

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def head_dim_of(config: PretrainedConfig) -> int:
    head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim


def layer_window(config: PretrainedConfig, layer_id: int) -> int | None:
    """The attention window of layer ``layer_id`` as HF applies it, or None for
    full attention: configs with per-layer ``layer_types`` (Qwen2, Gemma) slide
    where a layer says ``sliding_attention``; otherwise a set ``sliding_window``
    applies to every layer (Mistral). A window no shorter than the context is
    no window."""
    window: int | None = getattr(config, "sliding_window", None)
    if not window or window >= config.max_position_embeddings:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        kind = layer_types[layer_id]
        if kind not in ("full_attention", "sliding_attention"):
            raise NotImplementedError(f"layer {layer_id}: attention type {kind!r} is not supported")
        return window if kind == "sliding_attention" else None
    return window


def attention_facts(config: PretrainedConfig, **more: Any) -> ModelFacts:
    """The facts of a model whose attention reads ``config`` the Llama way (and, unless
    ``more`` says otherwise, whose every layer has a dense MLP of ``intermediate_size``)."""
    windows = [w for i in range(config.num_hidden_layers) if (w := layer_window(config, i)) is not None]
    more.setdefault("dense_intermediate_size", config.intermediate_size)
    return ModelFacts(
        head_dim=head_dim_of(config),
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        sliding_window=max(windows, default=None),
        **more,
    )


def fused_weight_name(name: str, stacked_params: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """``(parameter name, shard id)`` of checkpoint tensor ``name``: a projection
    in ``stacked_params`` (e.g. ``q_proj``) names its fused parameter and shard."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in stacked_params:
            fused, shard_id = stacked_params[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard_id
    return name, None


@dataclass(frozen=True)
class AttentionOptions:
    """What differs between the attention blocks of the Llama family."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # a norm over head_dim on q and k before rotary (Qwen3, Gemma 3)
    norm: type[Layer] = RMSNorm  # the class of those norms (Gemma's for Gemma 3)
    scaling: float | None = None  # the softmax scale (None: head_dim ** -0.5; Gemma's query_pre_attn_scalar)
    logit_softcap: float | None = None  # the attention score cap (Gemma 2)


class LlamaAttention(Layer):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        ctx: ModelContext,
        options: AttentionOptions,
        rotary_emb: RotaryEmbedding,
        input_size: int | None = None,
    ):
        """``input_size``: the width of what the block reads where it is not the
        hidden size (an EAGLE-3 head's layer reads two rows side by side)."""
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            input_size or config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            ctx,
            bias=options.qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, ctx, bias=options.o_bias
        )
        if options.qk_norm:
            self.q_norm = options.norm(head_dim, config.rms_norm_eps, ctx)
            self.k_norm = options.norm(head_dim, config.rms_norm_eps, ctx)
        self.qk_norm = options.qk_norm
        self.rotary_emb = rotary_emb  # shared by the layers that turn alike
        self.attn = PagedAttention(
            layer_id,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            ctx,
            scaling=options.scaling,
            sliding_window=layer_window(config, layer_id),
            logit_softcap=options.logit_softcap,
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        p = self.qkv_proj
        q, k, v = p(hidden).split([p.q_size, p.kv_size, p.kv_size], dim=-1)
        q = q.reshape(-1, p.num_heads, p.head_dim)
        k = k.reshape(-1, p.num_kv_heads, p.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        self.rotary_emb(batch.rope_rows, q, k)  # in place
        out: torch.Tensor = self.o_proj(self.attn(q, k, v, batch))
        return out


class LlamaMLP(Layer):
    """SiLU-gated MLP with gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx: ModelContext, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], ctx, bias=bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, ctx, bias=bias)
        self.act = ctx.elementwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.gate_up_proj.silu_and_mul(x, self.act))
        return out


class PreNormDecoderLayer(Layer):
    """RMSNorm, attention, RMSNorm, MLP, each with its residual add (Llama's block,
    and DeepSeek-V2's around its own attention and MLP)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, config: PretrainedConfig, ctx: ModelContext):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``: the residual add of each block is
        fused into the norm that follows it (the next layer's input norm, or the
        final norm). ``residual`` is None for the first layer."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        ctx: ModelContext,
        options: AttentionOptions,
        mlp: nn.Module,
        rotary_emb: RotaryEmbedding,
    ):
        super().__init__(LlamaAttention(config, layer_id, ctx, options, rotary_emb), mlp, config, ctx)


class LlamaModel(Layer):
    """The decoder stack: embedding, layers, final norm. With ``batch.capture_hidden``
    it keeps each new token's features for an EAGLE head in ``batch.hidden_states``:
    the final (normed) hidden state, or, where ``feature_layers`` names layers (an
    EAGLE-3 head's), those layers' outputs (the residual stream after them) side by
    side in that order."""

    def __init__(self, config: PretrainedConfig, ctx: ModelContext, layers: Iterable[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.feature_layers: tuple[int, ...] = ()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(batch.input_ids), None
        keep = self.feature_layers if batch.capture_hidden else ()
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, batch)
            if keep and i in keep:
                kept[i] = hidden + residual
        out: torch.Tensor = self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]
        if batch.capture_hidden:
            batch.hidden_states = torch.cat([kept[i] for i in keep], dim=-1) if keep else out
        return out


class LlamaForCausalLM(Layer):
    """Llama 2/3/3.1 (any supported rope scaling) and Mistral.

    Subclasses customise :meth:`attention_options` and :meth:`make_mlp`, and
    extend :meth:`map_weight_name` for extra checkpoint layouts.
    """

    architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM", "MistralForCausalLM")

    # checkpoint projection -> (fused parameter, shard id)
    stacked_params: dict[str, tuple[str, Any]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act!r} is not supported (only silu)")
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        options = self.attention_options(config)
        rotary_emb = RotaryEmbedding(config, head_dim_of(config), ctx)
        layers = (
            LlamaDecoderLayer(config, i, ctx, options, self.make_mlp(config, i, ctx), rotary_emb)
            for i in range(config.num_hidden_layers)
        )
        self.model = LlamaModel(config, ctx, layers)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.max_context_len = config.max_position_embeddings

    @classmethod
    def model_facts(cls, config: PretrainedConfig) -> ModelFacts:
        return attention_facts(config)

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_id: int, ctx: ModelContext) -> nn.Module:
        return LlamaMLP(
            config.hidden_size, config.intermediate_size, ctx, bias=bool(getattr(config, "mlp_bias", False))
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    def embed_and_head(self) -> tuple[nn.Module, nn.Module]:
        """The token embedding and the LM head, which an EAGLE head over this model
        shares (models/eagle.py); the forward keeps the hidden states such a head reads
        when ``batch.capture_hidden`` is set."""
        return self.model.embed_tokens, self.lm_head

    def keep_layer_outputs(self, layer_ids: Sequence[int]) -> None:
        """Keep the outputs of these layers as the features of ``batch.capture_hidden``
        (an EAGLE-3 head reads them) instead of the final hidden state."""
        count = len(self.model.layers)
        if not layer_ids or any(not 0 <= i < count for i in layer_ids):
            raise ValueError(f"layers {list(layer_ids)} to keep: the model has layers 0 to {count - 1}")
        self.model.feature_layers = tuple(layer_ids)

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        """HF checkpoint name -> (parameter name, shard id), or None to skip it."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return fused_weight_name(name, self.stacked_params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, self.map_weight_name)
