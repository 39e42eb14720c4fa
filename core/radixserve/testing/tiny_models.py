"""Tiny test models made on the fly, nothing downloaded: the builder of
``radixserve.model_builder`` (which builds the demo model too) under the testing
kit's name, and ``llama3_rope_scaling``, a configuration only tests use."""

from __future__ import annotations

from typing import Any

from radixserve.model_builder import (
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
