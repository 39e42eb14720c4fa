"""radixserve-plugin-rocm: AMD GPUs through a ROCm build of torch.

Registers (hookimpls below; the classes live in their own modules):

* platform ``rocm`` (``platform.py``): detected through ``torch.version.hip``,
  ``HIP_VISIBLE_DEVICES`` / ``ROCR_VISIBLE_DEVICES`` (``visibility.py``),
  memory from ``torch.cuda.mem_get_info``, ``nccl`` (RCCL), HIP graphs
  (``graphs.py``);
* attention and MoE ``triton_rocm`` (``kernels.py``): radixserve's Triton
  kernels with CDNA launch configurations.

GEMM is the torch plugin's (``torch``: hipBLASLt / rocBLAS under
``torch.nn.functional.linear``). Without triton the platform still serves, with
the torch attention and MoE backends. Imports only radixserve's public API, the
Triton plugin's public API (``radixserve_triton``) and torch.
"""

from __future__ import annotations

from radixserve.hooks import Register, hookimpl
from radixserve_rocm.kernels import CDNA_ATTENTION_CONFIG, CDNA_MOE_CONFIG, RocmTritonAttention, RocmTritonMoE
from radixserve_rocm.platform import RocmPlatform

__all__ = ["CDNA_ATTENTION_CONFIG", "CDNA_MOE_CONFIG", "RocmPlatform", "RocmTritonAttention", "RocmTritonMoE"]


@hookimpl
def register_platforms(register: Register) -> None:
    register(RocmPlatform)


@hookimpl
def register_attention_backends(register: Register) -> None:
    register(RocmTritonAttention)


@hookimpl
def register_moe_backends(register: Register) -> None:
    register(RocmTritonMoE)
