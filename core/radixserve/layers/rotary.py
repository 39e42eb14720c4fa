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
``long_factor``. HF picks one per forward call by the call's sequence length
(its last position + 1): the long set past ``original_max_position_embeddings``,
else the short set. In ``generate`` (Phi3ForCausalLM.prepare_inputs_for_generation)
the step at which a sequence first grows past the original context drops the
KV cache and recomputes the whole sequence, so at every step all of a
sequence's keys are rotated with the set of its current length. The table
here holds both sets, the short one in rows ``[0, max_position_embeddings)``
and the long one after it (:class:`LongRope`), and each token reads the rows
of its request's set (``ForwardBatch.rope_rows``). The scheduler reproduces
``generate``: a request (re)computed from its first token takes the set of its
length, and a request on the short set whose next decode step would take it
past the original context is computed again on the long set (its KV, and the
prefix cache's, are kept apart by ``Req.cache_namespace``). Both sets share the
attention factor (``attention_factor``, else ``sqrt(1 + ln(factor) / ln(original))``).
"""

from __future__ import annotations

from dataclasses import dataclass
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
    config: PretrainedConfig, head_dim: int, dtype: torch.dtype, layer_type: str | None = None
) -> torch.Tensor:
    """The cos/sin table (:func:`rope_cos_sin_cache`) of every position up to
    ``max_position_embeddings``; for longrope, the short set's table followed by
    the long set's (:class:`LongRope`)."""
    max_positions = config.max_position_embeddings
    rope_type, params = rope_parameters(config, layer_type)
    if rope_type != "longrope":
        return rope_cos_sin_cache(*rope_inv_freq(config, head_dim, layer_type=layer_type), max_positions, dtype)
    if layer_type is not None:
        raise NotImplementedError("longrope in per-layer-type rope parameters is not supported")
    original = params["original_max_position_embeddings"]
    # HF's sets for a call of the original context (short) and of one token more (long).
    sets = (rope_inv_freq(config, head_dim, seq_len=n) for n in (original, original + 1))
    return torch.cat([rope_cos_sin_cache(inv_freq, scaling, max_positions, dtype) for inv_freq, scaling in sets])


@dataclass(frozen=True)
class LongRope:
    """Where a longrope model's two sets of frequencies are and which one a
    request uses. Set 0 (short) is rows ``[0, table_rows)`` of the rotary table,
    set 1 (long) the next ``table_rows``; a token at position ``p`` of a request
    on set ``s`` reads row ``s * table_rows + p``."""

    original_context: int  # original_max_position_embeddings
    table_rows: int  # max_position_embeddings: the rows of one set

    @classmethod
    def of(cls, config: PretrainedConfig) -> LongRope | None:
        """The model's LongRoPE layout, or None when it does not use longrope (one set)."""
        rope_type, params = rope_parameters(config)
        if rope_type != "longrope":
            return None
        return cls(params["original_max_position_embeddings"], config.max_position_embeddings)

    def set_for(self, seq_len: int) -> int:
        """The set of a sequence of ``seq_len`` tokens, all of whose keys are computed
        with it (as HF computes a forward of that length): 1 (long) past the original context."""
        return int(seq_len > self.original_context)


class RotaryEmbedding(Layer):
    """Rotates q and k in place through ``ctx.elementwise`` with a cos/sin table
    of every position the model serves (``max_position_embeddings``; for
    longrope, of each set: :class:`LongRope`). One instance is shared by all
    layers of a model (of a ``layer_type``, where the rope parameters are per
    layer type)."""

    cos_sin_cache: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, config: PretrainedConfig, head_dim: int, ctx: ModelContext, layer_type: str | None = None):
        super().__init__()
        table = rope_table(config, head_dim, ctx.dtype, layer_type)
        self.register_buffer("cos_sin_cache", table, persistent=False)
        self.backend = ctx.elementwise

    def forward(self, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate q ``[T, heads, D]`` and k ``[T, kv_heads, D]`` in place, token ``t``
        by row ``rows[t]`` of the table (``ForwardBatch.rope_rows``: its position,
        in its request's set for longrope)."""
        self.backend.apply_rotary(q, k, rows, self.cos_sin_cache, neox_style=True)

    def extra_repr(self) -> str:
        return f"rows={self.cos_sin_cache.shape[0]}, rotary_dim={self.cos_sin_cache.shape[1]}"
