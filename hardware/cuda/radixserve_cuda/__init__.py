"""The CUDA platform. Imports only radixserve's public API and torch."""

from __future__ import annotations

import importlib.util

import torch

from radixserve.hooks import Register, hookimpl
from radixserve.platform import Platform


class CudaPlatform(Platform):
    name = "cuda"
    priority = 100
    torch_device_type = "cuda"
    dist_backend = "nccl"
    default_dtype = torch.bfloat16

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        if getattr(torch.version, "cuda", None) is None:
            return [f"torch {torch.__version__} is not a CUDA build"]
        if importlib.util.find_spec("triton") is None:
            return ["triton is not installed (pip install triton)"]
        # Counts devices through the driver without creating a context.
        if torch.cuda.device_count() == 0:
            return ["no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)"]
        return []

    def total_memory_bytes(self, index: int = 0) -> int:
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory_bytes(self, index: int = 0) -> int:
        free, _ = torch.cuda.mem_get_info(index)
        return free

    def describe(self, index: int = 0) -> str:
        props = torch.cuda.get_device_properties(index)
        return f"cuda:{index} {props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})"


@hookimpl
def register_platforms(register: Register) -> None:
    register(CudaPlatform)
