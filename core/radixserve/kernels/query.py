"""The one frozen, hashable query every backend candidate is asked about."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.cache.memory_pool import LatentKV


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """How a checkpoint's linear weights were quantized before it shipped (config.json's
    ``quantization_config``, read by ``radixserve.checkpoints.quantized``): integers of
    ``bits`` (or 8-bit floats: ``weight_type``) in groups of ``group_size`` input
    features (-1: one group a row; 0: one for the whole tensor), each group of each
    output feature with a scale and a zero point (``symmetric``: the zero point is the
    middle of the range), dequantized as ``(q - zero) * scale``; with ``activations``,
    the layers' inputs are quantized too (W8A8), per token as they come or per tensor
    by a scale the checkpoint stores."""

    method: str  # the quantization method that loads it: "gptq", "awq", ...
    bits: int
    group_size: int
    symmetric: bool
    desc_act: bool = False  # GPTQ's act-order: a column's group is g_idx's, not its index // group_size
    zero_offset: int = 0  # added to each stored zero point (GPTQ's own format stores it less one)
    weight_type: str = "int"  # "int" or "float" (float8 e4m3)
    activations: str | None = None  # None (weight-only), "token" (dynamic) or "tensor" (static scale)
    lm_head: bool = False  # the LM head is stored quantized too (GGUF files), else in floats


@dataclass(frozen=True)
class KernelQuery:
    """What the model needs from a kernel backend.

    Fields that do not apply to a kind stay ``None``; a candidate only looks at
    the fields its kind uses.
    """

    device: str
    dtype: torch.dtype
    head_dim: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    page_size: int = 1
    kv_dtype: torch.dtype | None = None
    num_experts: int | None = None
    top_k: int | None = None
    quantization: str | None = None
    # What the checkpoint's weights already are, when it ships quantized (GPTQ, AWQ).
    quantized_checkpoint: QuantizedCheckpoint | None = None
    # Attention features some layers use (the widest window; the cap): a backend
    # without them refuses the query. Per-layer values are on AttentionLayerSpec.
    sliding_window: int | None = None
    logit_softcap: float | None = None
    # The elementwise ops beyond the common three that the model calls (names from
    # kernels.elementwise.MODEL_SPECIFIC_OPS): a backend without one refuses the query.
    elementwise_ops: tuple[str, ...] | None = None
    # Multi-head latent attention (DeepSeek-V2): the KV pool holds one latent entry
    # per token (LatentKV) instead of K and V; only backends that declare MLA serve it.
    mla: LatentKV | None = None
    # LoRA serving (--enable-lora): the widest rank an adapter may have (None: LoRA off).
    max_lora_rank: int | None = None
    # A 16-bit checkpoint computed in a wider dtype (bfloat16 weights served in float32):
    # its dense weights hold values of this type exactly, which a GEMM backend may store
    # in it (half the bytes) and its timing draws weights from.
    weight_dtype: torch.dtype | None = None

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.__dict__.items() if v is not None]
        return ", ".join(parts)
