"""radixserve on Huawei Ascend NPUs through torch_npu: the ``npu`` platform,
``npu_fused`` attention and ``npu_grouped`` MoE. GEMM is torch's (torch_npu
runs ``torch.matmul`` on the NPU). Importing this module never imports
torch_npu; see ``ops``."""

from radixserve.hooks import Register, hookimpl
from radixserve_npu.attention import NpuFusedAttention
from radixserve_npu.moe import NpuGroupedMoE
from radixserve_npu.platform import NpuPlatform


@hookimpl
def register_platforms(register: Register) -> None:
    register(NpuPlatform)


@hookimpl
def register_attention_backends(register: Register) -> None:
    register(NpuFusedAttention)


@hookimpl
def register_moe_backends(register: Register) -> None:
    register(NpuGroupedMoE)
