"""DeepSeek-V2 and V2-Lite: multi-head latent attention (MLA) and DeepSeekMoE,
computed as transformers' ``modeling_deepseek_v2`` computes them.

Attention. Queries come from ``q_proj`` (V2-Lite: ``q_lora_rank`` None) or
from a compressed query (``q_a_proj``, its RMSNorm, ``q_b_proj``); each head's
query is a "nope" part and a rotary part. ``kv_a_proj_with_mqa`` gives every
token one latent ``c_kv`` (``kv_lora_rank``, RMS-normalised) and one rotary
key part shared by all heads; the KV pool keeps exactly these
(``LatentKVPool``), and the attention backend reads them through
``kv_b_proj`` (per head: the key's nope part, then the value; see
radixserve/kernels/mla.py). Rotary turns adjacent pairs (HF's complex
product) in float32 and rounds once, as HF does. The softmax scale is
``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under
YaRN (HF's ``yarn_apply_mscale``); YaRN's own attention factor scales cos and
sin (the rope tables).

MLP. The first ``first_k_dense_replace`` layers are dense; the rest are MoE:
router logits in float32 from a float32 gate (HF keeps the gate in float32),
softmax, top-k ``greedy`` or ``group_limited_greedy`` (``n_group`` groups
scored by their best expert, the experts of the best ``topk_group`` groups
compete), no renormalisation, weights times ``routed_scaling_factor``, plus
the shared experts (one SiLU MLP of ``n_shared_experts * moe_intermediate_size``)
on every token.

Tensor parallelism splits the heads: each rank holds its heads' rows of
``q_proj``/``q_b_proj`` and ``kv_b_proj`` and their columns of ``o_proj``
(all-reduced), while the latent down-projections (``q_a_proj``,
``kv_a_proj_with_mqa``) are replicated, so every rank caches the whole latent
of each token; the MLPs and experts split as Llama's and Qwen-MoE's do.

Not served (refused by name): settings that transformers' class ignores but
DeepSeek's original code applies (``moe_layer_freq`` other than 1,
``norm_topk_prob``), other scoring functions and top-k methods (V3's).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.cache.memory_pool import LatentKV
from radixserve.forward_batch import ForwardBatch
from radixserve.layers import (
    ColumnParallelLinear,
    FusedMoE,
    ParallelLMHead,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    expert_weight_name,
)
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer
from radixserve.layers.mla import LatentUpProjection, MultiHeadLatentAttention
from radixserve.layers.parallel import divide
from radixserve.layers.rotary import rope_cos_sin_cache, rope_inv_freq
from radixserve.layers.weights import load_named_weights
from radixserve.models.base import ModelFacts
from radixserve.models.llama import LlamaMLP, LlamaModel, PreNormDecoderLayer, fused_weight_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
# HF builds the q_a and kv_a norms with DeepseekV2RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6
TOPK_METHODS = ("greedy", "group_limited_greedy")


def check_supported(config: PretrainedConfig) -> None:
    """NotImplementedError naming a setting this model does not serve."""
    if getattr(config, "moe_layer_freq", 1) != 1:
        raise NotImplementedError(
            f"moe_layer_freq {config.moe_layer_freq} is not supported: transformers' DeepseekV2 ignores it "
            "while DeepSeek's own code applies it, so no behaviour is the reference"
        )
    if getattr(config, "norm_topk_prob", False):
        raise NotImplementedError(
            "norm_topk_prob=True is not supported: transformers' DeepseekV2 ignores it while DeepSeek's own code "
            "applies it, so no behaviour is the reference"
        )
    scoring = getattr(config, "scoring_func", "softmax")
    if scoring != "softmax":
        raise NotImplementedError(f"scoring_func {scoring!r} is not supported (DeepSeek-V2 scores with softmax)")
    if config.topk_method not in TOPK_METHODS:
        raise NotImplementedError(f"topk_method {config.topk_method!r} is not supported; supported: {TOPK_METHODS}")


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config: PretrainedConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` with YaRN's ``mscale_all_dim`` (HF's ``yarn_apply_mscale``)."""
    scale = float((config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5)
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim", 0):
        mscale = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class DeepseekV2Rotary(Layer):
    """Rotary over the rope part of queries and keys as HF's DeepSeek-V2 turns it:
    adjacent pairs ``(x[2i], x[2i + 1])`` (a complex product: GPT-J style) in
    float32 with float32 cos/sin, rounded to the model dtype once. The rotation
    runs through ``ctx.elementwise`` on float32 copies (in place in a float32
    model). One instance is shared by all layers."""

    cos_sin_cache: torch.Tensor  # a buffer

    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(config, config.qk_rope_head_dim)
        cache = rope_cos_sin_cache(inv_freq, attention_scaling, config.max_position_embeddings, torch.float32)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.backend = ctx.elementwise

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[T, heads, R]`` and the shared ``k`` ``[T, R]``, rotated."""
        q32, k32 = q.float(), k.float().unsqueeze(1)
        self.backend.apply_rotary(q32, k32, positions, self.cos_sin_cache, neox_style=False)
        return q32.to(q.dtype), k32.squeeze(1).to(k.dtype)


class DeepseekV2Attention(Layer):
    def __init__(self, config: PretrainedConfig, layer_id: int, ctx: ModelContext, rotary: DeepseekV2Rotary):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.num_heads = divide(heads, ctx.tp_size)  # this rank's
        qk_head_dim = self.nope + self.rope
        bias = bool(config.attention_bias)
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_head_dim, ctx)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, ctx, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, ctx)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_head_dim, ctx)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope, ctx, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, ctx)
        self.kv_b_proj = LatentUpProjection(heads, self.nope, config.v_head_dim, self.kv_lora_rank, ctx)
        self.o_proj = RowParallelLinear(heads * config.v_head_dim, hidden, ctx, bias=bias)
        self.rotary = rotary
        self.attn = MultiHeadLatentAttention(
            layer_id, heads, self.kv_lora_rank, self.nope, self.rope, config.v_head_dim, softmax_scale(config), ctx
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_rope = q.view(-1, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = self.rotary(batch.positions, q_rope, k_rope)
        out: torch.Tensor = self.o_proj(self.attn(q_nope, q_rope, latent, k_rope, self.kv_b_proj.per_head(), batch))
        return out


class DeepseekV2Router(Layer):
    """Router logits ``[T, E]`` in float32 from a float32 weight, as HF keeps the
    gate (``_keep_in_fp32_modules_strict``). The GEMM backends serve the model
    dtype, so this small ``[T, H] x [H, E]`` product is plain torch."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)


class DeepseekV2MoE(Layer):
    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__()
        grouped = config.topk_method == "group_limited_greedy"
        self.gate = DeepseekV2Router(config.hidden_size, config.n_routed_experts)
        self.experts = FusedMoE(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            ctx=ctx,
            renormalize=False,
            num_groups=config.n_group if grouped else 1,
            topk_groups=config.topk_group if grouped else 1,
            scaling_factor=config.routed_scaling_factor,
        )
        self.shared_experts = LlamaMLP(
            config.hidden_size,
            config.moe_intermediate_size * config.n_shared_experts,
            ctx,
            bias=bool(config.mlp_bias),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.experts(x, self.gate(x)) + self.shared_experts(x)
        return out


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, layer_id: int, ctx: ModelContext, rotary: DeepseekV2Rotary):
        mlp: nn.Module
        if layer_id >= config.first_k_dense_replace:
            mlp = DeepseekV2MoE(config, ctx)
        else:
            mlp = LlamaMLP(config.hidden_size, config.intermediate_size, ctx, bias=bool(config.mlp_bias))
        super().__init__(DeepseekV2Attention(config, layer_id, ctx, rotary), mlp, config, ctx)


class DeepseekV2ForCausalLM(Layer):
    architectures = ("DeepseekV2ForCausalLM",)

    # checkpoint projection -> (fused parameter, shard id): the dense MLP's and the shared experts'
    stacked_params: dict[str, tuple[str, Any]] = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__()
        check_supported(config)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act!r} is not supported (only silu)")
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        rotary = DeepseekV2Rotary(config, ctx)
        layers = (DeepseekV2DecoderLayer(config, i, ctx, rotary) for i in range(config.num_hidden_layers))
        self.model = LlamaModel(config, ctx, layers)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.max_context_len = config.max_position_embeddings

    @classmethod
    def model_facts(cls, config: PretrainedConfig) -> ModelFacts:
        sparse = config.num_hidden_layers > config.first_k_dense_replace
        return ModelFacts(
            head_dim=config.qk_nope_head_dim + config.qk_rope_head_dim,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_attention_heads,
            num_experts=config.n_routed_experts if sparse else 0,
            top_k=config.num_experts_per_tok if sparse else 0,
            moe_intermediate_size=config.moe_intermediate_size if sparse else 0,
            dense_intermediate_size=(
                config.moe_intermediate_size * (config.n_shared_experts or 0)
                if 2 * config.first_k_dense_replace < config.num_hidden_layers
                else config.intermediate_size
            ),
            mla=LatentKV(kv_lora_rank=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim),
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        """HF checkpoint name -> (parameter name, shard id), or None to skip it."""
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        expert = expert_weight_name(name, _PER_EXPERT, _PART)
        if expert is not None:
            return expert
        return fused_weight_name(name, self.stacked_params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, self.map_weight_name)
