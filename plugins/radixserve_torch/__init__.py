"""Reference backends in plain PyTorch: device ``cpu``, and the numerical ground
truth every other backend is tested against. Registered through the
``radixserve`` entry point exactly as a third-party plugin would be."""

from radixserve.hooks import Register, hookimpl
from radixserve_torch.attention import TorchNativeAttention
from radixserve_torch.attention_cpu_paged import CpuPagedAttention
from radixserve_torch.attention_mla import TorchMLAAttention
from radixserve_torch.attention_varlen import TorchVarlenAttention
from radixserve_torch.elementwise import TorchNativeElementwise
from radixserve_torch.elementwise_cpu import CpuFusedElementwise
from radixserve_torch.gemm import CpuPackedGemm, OneDnnGemm, TorchGemm
from radixserve_torch.lora import TorchGroupedLoRA, TorchNativeLoRA
from radixserve_torch.lora_cpu import CpuSgmvLoRA
from radixserve_torch.moe import TorchNativeMoE
from radixserve_torch.platform import CpuPlatform
from radixserve_torch.quantization import Int8WeightOnly, NoQuantization
from radixserve_torch.quantized_checkpoints import (
    AWQ,
    GPTQ,
    CompressedTensors,
    CompressedTensorsW8A8,
    FP8Blocks,
    GGUFBlocks,
)


@hookimpl
def register_platforms(register: Register) -> None:
    register(CpuPlatform)


@hookimpl
def register_attention_backends(register: Register) -> None:
    register(TorchNativeAttention)
    register(TorchVarlenAttention)
    register(CpuPagedAttention)
    register(TorchMLAAttention)


@hookimpl
def register_gemm_backends(register: Register) -> None:
    register(TorchGemm)
    register(OneDnnGemm)
    register(CpuPackedGemm)


@hookimpl
def register_moe_backends(register: Register) -> None:
    register(TorchNativeMoE)


@hookimpl
def register_lora_backends(register: Register) -> None:
    register(TorchNativeLoRA)
    register(TorchGroupedLoRA)
    register(CpuSgmvLoRA)


@hookimpl
def register_elementwise_backends(register: Register) -> None:
    register(TorchNativeElementwise)
    register(CpuFusedElementwise)


@hookimpl
def register_quantization_methods(register: Register) -> None:
    register(NoQuantization)
    register(Int8WeightOnly)
    register(GPTQ)
    register(AWQ)
    register(CompressedTensors)
    register(FP8Blocks)
    register(GGUFBlocks)
    register(CompressedTensorsW8A8)
