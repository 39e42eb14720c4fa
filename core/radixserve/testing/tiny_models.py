"""Tiny test models made on the fly, nothing downloaded: the builder of
``radixserve.checkpoints.random_model`` (which builds the demo model too) under the testing
kit's name, and ``llama3_rope_scaling`` and ``longrope_scaling``, configurations
only tests use."""

from __future__ import annotations

from typing import Any

from radixserve.checkpoints.random_model import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END,
    IM_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    THINK_END,
    THINK_START,
    build_tiny_model,
    build_tokenizer,
    tiny_config,
)

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "IM_END",
    "IM_START",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "THINK_END",
    "THINK_START",
    "build_tiny_model",
    "build_tokenizer",
    "llama3_rope_scaling",
    "longrope_scaling",
    "tiny_config",
]


def llama3_rope_scaling(
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 64,
) -> dict[str, Any]:
    """A Llama 3.1-style ``rope_scaling``. The default original context (64) is
    small so that, at a tiny head_dim, some frequencies are kept, some scaled and
    some smoothed: every branch of the llama3 formula is exercised."""
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low_freq_factor,
        "high_freq_factor": high_freq_factor,
        "original_max_position_embeddings": original_max_position_embeddings,
    }


def longrope_scaling(head_dim: int = 16) -> dict[str, Any]:
    """A Phi-3 128k-style LongRoPE ``rope_scaling`` for ``head_dim``: short factors
    near 1, long factors growing towards the low frequencies, one per frequency.
    Pair it with a small ``original_max_position_embeddings`` (a config field, as
    in Phi-3's config.json) so that generation crosses it."""
    n = head_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(n)],
        "long_factor": [1.0 + 0.5 * i * i for i in range(n)],
    }
