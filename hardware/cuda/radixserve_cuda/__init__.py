"""radixserve-plugin-cuda: NVIDIA GPUs. Imports only radixserve's public API and torch.

What it registers (hookimpls below; the classes live in their own modules):

* platform ``cuda`` (``platform.py``): NVML-based probing (no CUDA context in the
  probing process), ``--base-gpu-id``, memory from ``torch.cuda.mem_get_info``,
  ``nccl``; CUDA graphs (``graphs.py``);
* quantization ``fp8`` and ``fp8_per_tensor`` (``fp8.py``): w8a8 through
  ``torch._scaled_mm`` on compute capability >= 8.9;
* attention ``flashinfer`` (``flashinfer_attention.py``, with the ``flashinfer`` extra).

Attention and MoE otherwise come from radixserve's Triton plugin (``triton``,
when triton is installed) or its torch plugin; GEMM from torch (cuBLAS). The
platform is usable without triton.
"""

from __future__ import annotations

from radixserve.hooks import Register, hookimpl
from radixserve_cuda.fp8 import Fp8W8A8, Fp8W8A8PerTensor
from radixserve_cuda.platform import CudaPlatform

__all__ = ["CudaPlatform", "Fp8W8A8", "Fp8W8A8PerTensor"]


@hookimpl
def register_platforms(register: Register) -> None:
    register(CudaPlatform)


@hookimpl
def register_quantization_methods(register: Register) -> None:
    register(Fp8W8A8)
    register(Fp8W8A8PerTensor)


@hookimpl
def register_attention_backends(register: Register) -> None:
    # The module imports flashinfer only when the backend is built.
    from radixserve_cuda.flashinfer_attention import FlashInferAttention

    register(FlashInferAttention)
