"""The plugin contract: one bodiless hookspec per kind of device-specific piece.

A plugin is any module or object with functions marked ``@hookimpl`` whose names
match these specs. Each hook receives a ``register`` callback and calls it once
per class it provides; it returns nothing. A plugin implements only the hooks
it has. Plugins are found through the ``radixserve`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

PROJECT_NAME = "radixserve"
ENTRY_POINT_GROUP = "radixserve"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[type], None]


@hookspec
def register_platforms(register: Register) -> None:
    """Register :class:`radixserve.platform.Platform` subclasses."""


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register :class:`radixserve.kernels.attention.AttentionBackend` subclasses."""


@hookspec
def register_gemm_backends(register: Register) -> None:
    """Register :class:`radixserve.kernels.gemm.GemmBackend` subclasses."""


@hookspec
def register_moe_backends(register: Register) -> None:
    """Register :class:`radixserve.kernels.moe.MoEBackend` subclasses."""


@hookspec
def register_lora_backends(register: Register) -> None:
    """Register :class:`radixserve.kernels.lora.LoRABackend` subclasses (multi-LoRA serving:
    each request's adapter update, batched; chosen by ``--lora-backend``)."""


@hookspec
def register_elementwise_backends(register: Register) -> None:
    """Register :class:`radixserve.kernels.elementwise.ElementwiseBackend` subclasses
    (RMSNorm with fused residual, rotary in place, SiLU-and-mul)."""


@hookspec
def register_quantization_methods(register: Register) -> None:
    """Register :class:`radixserve.kernels.quantization.QuantizationMethod` subclasses."""


@hookspec
def register_models(register: Register) -> None:
    """Register model classes (``torch.nn.Module`` subclasses with an
    ``architectures`` tuple naming the HuggingFace architectures they serve)."""


@hookspec
def register_kv_transfer_backends(register: Register) -> None:
    """Register :class:`radixserve.kernels.kv_transfer.KVTransferBackend` subclasses (prefill/decode
    disaggregation: how KV moves between workers; chosen by ``--disaggregation-transfer-backend``)."""


@hookspec
def register_grammar_backends(register: Register) -> None:
    """Register :class:`radixserve.structured_output.backend.GrammarBackend` subclasses (structured
    output; chosen by ``--grammar-backend``)."""


@hookspec
def register_speculative_proposers(register: Register) -> None:
    """Register :class:`radixserve.speculative.base.Proposer` subclasses (speculative
    decoding; chosen by ``--speculative-algorithm``)."""


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register :class:`radixserve.tool_parsers.base.ToolParser` subclasses (tool calling;
    chosen by ``--tool-call-parser`` or detected from the chat template)."""


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register :class:`radixserve.reasoning_parsers.base.ReasoningParser` subclasses (reasoning
    split from content; chosen by ``--reasoning-parser``)."""
