"""Portable Triton kernels: paged attention (``triton``), multi-head latent
attention decode (``triton_mla``), fused MoE (``triton``), batched LoRA
(``triton``: SGMV shrink and expand) and the elementwise ops (``triton``:
RMSNorm + residual, rotary, SiLU-and-mul). They run on CUDA and ROCm, and on
CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter: slow, for tests).
Registered through the ``radixserve`` entry point ``triton``.

Importing this module never imports triton (triton is an optional extra,
``pip install 'radixserve[triton]'``): the kernels load when a backend is
constructed, and ``unsupported_reasons`` says so when triton is absent.

Public API for other plugins (``__all__``): the backend classes and the launch
configurations of attention, MoE and LoRA. A hardware plugin reuses the
kernels with its own block sizes by subclassing a backend and setting
``kernel_config`` (and its own ``name``, ``priority`` and
``unsupported_reasons``), as the ROCm plugin does.
"""

from radixserve.hooks import Register, hookimpl
from radixserve_triton.attention import TritonAttention
from radixserve_triton.config import (
    DEFAULT_ATTENTION_CONFIG,
    DEFAULT_LORA_CONFIG,
    DEFAULT_MOE_CONFIG,
    AttentionKernelConfig,
    LoRAKernelConfig,
    MoEKernelConfig,
)
from radixserve_triton.elementwise import TritonElementwise
from radixserve_triton.lora import TritonLoRA
from radixserve_triton.mla import TritonMLAAttention
from radixserve_triton.moe import TritonMoE

__all__ = [
    "DEFAULT_ATTENTION_CONFIG",
    "DEFAULT_LORA_CONFIG",
    "DEFAULT_MOE_CONFIG",
    "AttentionKernelConfig",
    "LoRAKernelConfig",
    "MoEKernelConfig",
    "TritonAttention",
    "TritonElementwise",
    "TritonLoRA",
    "TritonMLAAttention",
    "TritonMoE",
]


@hookimpl
def register_attention_backends(register: Register) -> None:
    register(TritonAttention)
    register(TritonMLAAttention)


@hookimpl
def register_moe_backends(register: Register) -> None:
    register(TritonMoE)


@hookimpl
def register_lora_backends(register: Register) -> None:
    register(TritonLoRA)


@hookimpl
def register_elementwise_backends(register: Register) -> None:
    register(TritonElementwise)
