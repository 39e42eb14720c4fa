"""Rotary position embedding (NeoX "rotate half" layout, as in HF Llama).

Inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` so every
scaling variant matches HuggingFace bit for bit; cos/sin are computed per step
from the token positions exactly as HF computes them, with no length-limited cache.

Supported ``rope_type``: default, linear, llama3, yarn and dynamic. Dynamic NTK
in HF rescales once a *batch* grows past ``max_position_embeddings``; within that
length it equals the default, which is what is computed here (serve such models
with a context length no larger than ``max_position_embeddings``). Types whose
frequencies depend on the running sequence length in other ways (longrope) are
rejected loudly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def rope_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] float32, attention_scaling)`` for ``config``."""
    # transformers 5 keeps everything in rope_parameters; 4.x had rope_scaling + rope_theta
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # lazy: keeps plugin discovery light

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError(f"rope produced {inv_freq.numel()} frequencies for head_dim {head_dim}")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim]`` in ``dtype`` for positions ``[T]``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, heads, D]`` and k ``[T, kv_heads, D]`` by cos/sin ``[T, 1, D]``."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
