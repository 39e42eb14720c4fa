"""The contract every model class (built-in or from a plugin) follows.

A model class is an ``nn.Module`` registered through the ``register_models``
hook. The model loader constructs it on the target device, feeds it the
checkpoint, then lets the quantization method post-process its linear layers.
Served for embeddings, its ``ParallelLMHead`` is replaced by one that passes the
final hidden states through (radixserve/layers/pooler.py), so a forward that
ends in that head needs nothing more to embed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import torch

from radixserve.cache.memory_pool import LatentKV

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.forward_batch import ForwardBatch
    from radixserve.layers.context import ModelContext


@dataclass(frozen=True)
class ModelFacts:
    """What backend selection must know of a model before it is built (whole
    model, before tensor parallelism splits heads): the model class reads them
    from its config, so a plugin's model states its own."""

    head_dim: int
    num_heads: int
    num_kv_heads: int
    num_experts: int = 0  # 0: a dense model
    top_k: int = 0  # experts per token
    moe_intermediate_size: int = 0  # each expert's intermediate size (whole, before tensor parallelism)
    # The intermediate size of the MLPs the GEMM backend runs in most layers (dense layers'
    # or shared experts'; whole); 0 when every layer's MLP is routed experts alone (Mixtral).
    dense_intermediate_size: int = 0
    sliding_window: int | None = None  # the widest window of any windowed layer
    logit_softcap: float | None = None  # attention score cap
    elementwise_ops: tuple[str, ...] = ()  # model-specific elementwise ops it calls (kernels.MODEL_SPECIFIC_OPS)
    mla: LatentKV | None = None  # multi-head latent attention: the KV pool's latent entry


@runtime_checkable
class CausalLM(Protocol):
    #: HuggingFace ``config.architectures`` names this class serves.
    architectures: ClassVar[tuple[str, ...]]
    #: Longest sequence the model computes exactly like HuggingFace (tokens).
    max_context_len: int

    def __init__(self, config: PretrainedConfig, ctx: ModelContext) -> None: ...

    @classmethod
    def model_facts(cls, config: PretrainedConfig) -> ModelFacts:
        """The facts of the model in ``config`` that kernels depend on."""
        ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits ``[len(batch.logits_indices), vocab]`` for the flat
        new-token positions in ``batch.logits_indices`` (all new tokens when it is
        None). The attention backend's ``init_forward_metadata(batch)`` must have
        been called for this step."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume ``(HF checkpoint name, tensor)`` pairs; raise on a tensor that
        fits nothing or a parameter left unfilled."""
        ...


def check_served_alone(model_class: type, model_path: str | Path) -> None:
    """Refuse, naming what to do instead, a class that only runs attached to another
    model (``serves_only_attached``: an EAGLE head) given as the model to serve."""
    attached = getattr(model_class, "serves_only_attached", None)
    if attached is not None:
        raise ValueError(f"model_path: {model_path} is {attached}")
