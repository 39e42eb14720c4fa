"""Rotary position embedding (NeoX "rotate half" layout, as in HF Llama).

Inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` so every
scaling variant matches HuggingFace bit for bit; the cos/sin table holds, for
every position up to ``max_position_embeddings`` (the longest context a model
serves), exactly the values HF computes per step. The rotation itself is the
elementwise backend's ``apply_rotary`` (in place on q and k).

Supported ``rope_type``: default, linear, llama3, yarn, dynamic and longrope.
Dynamic NTK in HF rescales once a *batch* grows past ``max_position_embeddings``;
within that length it equals the default, which is what is computed here (serve
such models with a context length no larger than ``max_position_embeddings``).

LongRoPE (Phi-3 128k) has two sets of frequencies, ``short_factor`` and
``long_factor``. HF picks one per forward call, the long set when the sequence
is longer than ``original_max_position_embeddings``, and in ``generate``
recomputes a sequence's whole KV cache with the long set once it grows past
that length (Phi3ForCausalLM.prepare_inputs_for_generation), so every token a
long sequence attends to is rotated with the long set. A static table cannot
switch a request's cached keys, so the set is fixed per server, as vLLM fixes
it: the long set when the server's context (``ModelContext.context_length``,
i.e. ``--context-length``, else ``max_position_embeddings``) exceeds the
original one, else the short set. That equals HF exactly for every sequence
when the context is the original one or less; with a longer context, for every
request whose prompt is longer than the original context, while a shorter one
HF runs with the short set (recomputing it with the long set if it grows past)
and here has the long set throughout. Both sets share the attention factor
(``attention_factor``, else ``sqrt(1 + ln(factor) / ln(original))``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixserve.kernels.elementwise import rope_cos_sin_cache as rope_cos_sin_cache  # re-exported (models, tests)
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> tuple[str, dict[str, Any]]:
    """``(rope_type, settings)``: transformers 5 keeps everything in
    rope_parameters; 4.x had rope_scaling + rope_theta. With ``layer_type``,
    those of the layers of that type in a config whose ``rope_parameters`` are
    per layer type (Gemma 3: local and global layers turn at different frequencies)."""
    params: dict[str, Any] = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    if layer_type is not None:
        params = dict(params[layer_type])
    rope_type: str = params.get("rope_type", params.get("type", "default"))
    return rope_type, params


def rope_inv_freq(
    config: PretrainedConfig, head_dim: int, seq_len: int | None = None, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim // 2] float32, attention_scaling)`` for ``config``
    (for its layers of ``layer_type``, see :func:`rope_parameters`); ``seq_len``:
    the length of the forward call, for the types whose frequencies depend on it
    (longrope: the long set past the original context). ``rotary_dim`` is
    ``head_dim`` times the ``partial_rotary_factor`` (Phi-4-mini: 0.75); only
    the first ``rotary_dim`` dimensions of each head turn."""
    rope_type, params = rope_parameters(config, layer_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    rotary_dim = rotary_dims(config, head_dim, layer_type)
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # lazy: keeps plugin discovery light

    per_type = {"layer_type": layer_type} if layer_type is not None else {}  # transformers 4.x has no layer_type
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len, **per_type)
    if inv_freq.numel() * 2 != rotary_dim:
        raise ValueError(f"rope produced {inv_freq.numel()} frequencies for rotary_dim {rotary_dim}")
    return inv_freq.float(), float(scaling)


def rotary_dims(config: PretrainedConfig, head_dim: int, layer_type: str | None = None) -> int:
    """How many of a head's ``head_dim`` dimensions turn: all, or the
    ``partial_rotary_factor`` of them (in ``rope_parameters`` in transformers 5,
    a config attribute in 4.x), as HF rounds it down."""
    _, params = rope_parameters(config, layer_type)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    rotary_dim = int(head_dim * factor)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} of head_dim {head_dim} gives {rotary_dim} rotary dimensions")
    return rotary_dim


def rope_table(
    config: PretrainedConfig,
    head_dim: int,
    dtype: torch.dtype,
    context_length: int | None = None,
    layer_type: str | None = None,
) -> torch.Tensor:
    """The cos/sin table (:func:`rope_cos_sin_cache`) of every position up to
    ``max_position_embeddings``; ``context_length`` (None: that many) chooses
    longrope's set of frequencies."""
    max_positions = config.max_position_embeddings
    rope_type, params = rope_parameters(config, layer_type)
    seq_len = None
    if rope_type == "longrope" and (context_length or max_positions) > params["original_max_position_embeddings"]:
        seq_len = params["original_max_position_embeddings"] + 1  # any longer call takes the long set
    inv_freq, attention_scaling = rope_inv_freq(config, head_dim, seq_len=seq_len, layer_type=layer_type)
    return rope_cos_sin_cache(inv_freq, attention_scaling, max_positions, dtype)


class RotaryEmbedding(Layer):
    """Rotates q and k in place through ``ctx.elementwise`` with a cos/sin table
    of every position the model serves (``max_position_embeddings``). One
    instance is shared by all layers of a model (of a ``layer_type``, where the
    rope parameters are per layer type)."""

    cos_sin_cache: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, config: PretrainedConfig, head_dim: int, ctx: ModelContext, layer_type: str | None = None):
        super().__init__()
        table = rope_table(config, head_dim, ctx.dtype, ctx.context_length, layer_type)
        self.register_buffer("cos_sin_cache", table, persistent=False)
        self.backend = ctx.elementwise

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate q ``[T, heads, D]`` and k ``[T, kv_heads, D]`` for ``positions`` ``[T]``, in place."""
        self.backend.apply_rotary(q, k, positions, self.cos_sin_cache, neox_style=True)

    def extra_repr(self) -> str:
        return f"max_positions={self.cos_sin_cache.shape[0]}, rotary_dim={self.cos_sin_cache.shape[1]}"
