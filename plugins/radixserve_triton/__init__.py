"""Portable Triton kernels: paged attention (``triton``) and fused MoE
(``triton``). They run on CUDA and ROCm, and on CPU under ``TRITON_INTERPRET=1``
(Triton's interpreter: slow, for tests). Registered through the ``radixserve``
entry point ``triton``.

Importing this module never imports triton (triton is an optional extra,
``pip install 'radixserve[triton]'``): the kernels load when a backend is
constructed, and ``unsupported_reasons`` says so when triton is absent.
"""

from radixserve.hooks import Register, hookimpl

from radixserve_triton.attention import TritonAttention
from radixserve_triton.moe import TritonMoE

__all__ = ["TritonAttention", "TritonMoE"]


@hookimpl
def register_attention_backends(register: Register) -> None:
    register(TritonAttention)


@hookimpl
def register_moe_backends(register: Register) -> None:
    register(TritonMoE)
