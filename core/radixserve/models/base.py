"""The contract every model class (built-in or from a plugin) follows.

A model class is an ``nn.Module`` registered through the ``register_models``
hook. The model loader constructs it on the target device, feeds it the
checkpoint, then lets the quantization method post-process its linear layers.
Served for embeddings, its ``ParallelLMHead`` is replaced by one that passes the
final hidden states through (radixserve/layers/pooler.py), so a forward that
ends in that head needs nothing more to embed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Iterable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.forward_batch import ForwardBatch
    from radixserve.layers.context import ModelContext


@runtime_checkable
class CausalLM(Protocol):
    #: HuggingFace ``config.architectures`` names this class serves.
    architectures: ClassVar[tuple[str, ...]]
    #: Longest sequence the model computes exactly like HuggingFace (tokens).
    max_context_len: int

    def __init__(self, config: "PretrainedConfig", ctx: "ModelContext") -> None: ...

    def forward(self, batch: "ForwardBatch") -> torch.Tensor:
        """Float32 logits ``[len(batch.logits_indices), vocab]`` for the flat
        new-token positions in ``batch.logits_indices`` (all new tokens when it is
        None). The attention backend's ``init_forward_metadata(batch)`` must have
        been called for this step."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume ``(HF checkpoint name, tensor)`` pairs; raise on a tensor that
        fits nothing or a parameter left unfilled."""
        ...
