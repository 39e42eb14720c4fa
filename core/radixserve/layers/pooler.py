"""Embeddings from a decoder: its final hidden states, pooled.

A model served for embeddings keeps its architecture; the model loader swaps its
LM head for ``HiddenStatesHead``, so the model's forward returns the final hidden
states (after the final norm) of the positions it would have scored, in float32,
instead of logits. Every architecture whose forward ends in a ``ParallelLMHead``
gets this without a line of its own.

``Pooler`` turns those rows into embeddings: a prompt is pooled over its last
token (``last``, as Qwen3-Embedding and gte-Qwen2) or the mean of all its tokens
(``mean``), then L2-normalised if asked. A prompt may arrive in several prefill
chunks: ``reduce`` gives each chunk's part (the sum of its rows for ``mean``, its
last row for ``last``), parts of one prompt add up, and ``finish`` turns the total
into the embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.config import POOLING_METHODS, PoolingMethod
from radixserve.layers.layer import Layer


class HiddenStatesHead(Layer):
    """Stands where the LM head was: it passes the (final-normed) hidden states through."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class Pooler:
    def __init__(self, method: PoolingMethod, normalize: bool):
        if method not in POOLING_METHODS:
            raise ValueError(f"pooling: must be one of {POOLING_METHODS}, got {method!r}")
        self.method, self.normalize = method, normalize

    def reduce(self, hidden: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``[len(counts), H]``: for each segment of ``counts[i]`` consecutive rows of
        ``hidden`` (``counts`` adds up to its rows), the sum of its rows (mean) or its
        last row (last)."""
        if self.method == "last":
            return hidden[counts.cumsum(0) - 1]
        # With its size given, repeat_interleave does not wait for the device to read ``counts``.
        segments = torch.arange(len(counts), device=hidden.device)
        segment = torch.repeat_interleave(segments, counts, output_size=hidden.shape[0])
        sums = torch.zeros(len(counts), hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
        return sums.index_add_(0, segment, hidden)

    def finish(self, reduced: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The embeddings of prompts of ``lengths`` tokens from their reduced rows."""
        pooled = reduced / lengths[:, None].to(reduced.dtype) if self.method == "mean" else reduced
        return F.normalize(pooled, p=2.0, dim=-1) if self.normalize else pooled
