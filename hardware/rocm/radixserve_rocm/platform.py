"""The ``rocm`` platform: AMD GPUs through a ROCm (HIP) build of torch.

A ROCm build is recognised by ``torch.version.hip``; its devices are torch's
``cuda`` devices, ``torch.cuda.*`` drives them (HIP underneath) and the
``nccl`` backend of ``torch.distributed`` is RCCL. Probing creates no device
context: ``torch.cuda.device_count()`` asks amdsmi when it is installed and
otherwise ``hipGetDeviceCount``; memory and properties are read only in the
scheduler process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.profiler import ProfilerActivity

from radixserve.platform import Platform
from radixserve_rocm.visibility import RocmVisibleDevices, rocm_visible_devices

if TYPE_CHECKING:
    from radixserve_rocm.graphs import HipGraphBackend


def reusable_free_bytes(free: int, reserved: int, allocated: int) -> int:
    """What this process can still allocate: the driver's free memory plus the
    blocks torch's caching allocator holds without using."""
    return free + max(0, reserved - allocated)


def build_reasons(hip_version: object, cuda_version: object, torch_version: str) -> list[str]:
    """Why this torch cannot drive AMD GPUs (empty for a ROCm build)."""
    if hip_version:
        return []
    reason = (
        f"torch {torch_version} is not a ROCm build (torch.version.hip is unset); install torch for ROCm "
        "from https://pytorch.org/get-started/locally/"
    )
    if cuda_version:
        reason += " (this one is a CUDA build: use --device cuda with radixserve-plugin-cuda)"
    return [reason]


def visible_device_reasons(visible: RocmVisibleDevices, count: int) -> list[str]:
    if visible.hides_all:
        return [f"no ROCm device is visible: {visible.describe()} selects none"]
    if count == 0:
        return [
            "no ROCm device is visible (check the amdgpu driver with rocm-smi, access to /dev/kfd and "
            "/dev/dri, and HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES)"
        ]
    return []


class RocmPlatform(Platform):
    """AMD Instinct (CDNA) and Radeon GPUs. Device ``index`` is torch's
    ``cuda:index`` in the visible order; the model runner asks for
    ``--base-gpu-id + tp_rank``."""

    name = "rocm"
    priority = 100  # a torch build is either CUDA or ROCm, so this never competes with ``cuda``
    torch_device_type = "cuda"
    dist_backend = "nccl"  # RCCL on ROCm builds
    default_dtype = torch.bfloat16
    pinned_host_staging = True

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        reasons = build_reasons(
            getattr(torch.version, "hip", None), getattr(torch.version, "cuda", None), torch.__version__
        )
        if reasons:
            return reasons
        visible = rocm_visible_devices()
        count = 0 if visible.hides_all else torch.cuda.device_count()
        return visible_device_reasons(visible, count)

    def device(self, index: int = 0) -> torch.device:
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ValueError(
                f"base_gpu_id: rocm device {index} does not exist: {count} device(s) are visible "
                f"({rocm_visible_devices().describe()})"
            )
        return torch.device("cuda", index)

    def total_memory_bytes(self, index: int = 0) -> int:
        return torch.cuda.mem_get_info(index)[1]

    def available_memory_bytes(self, index: int = 0) -> int:
        free, _ = torch.cuda.mem_get_info(index)
        return reusable_free_bytes(free, torch.cuda.memory_reserved(index), torch.cuda.memory_allocated(index))

    def bind_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def describe(self, index: int = 0) -> str:
        props = torch.cuda.get_device_properties(index)
        arch = getattr(props, "gcnArchName", "").split(":")[0] or "?"
        visible = rocm_visible_devices()
        where = "" if visible.ids is None else f", physical {visible.physical(index)}"
        return f"rocm:{index} {props.name} ({props.total_memory / 2**30:.0f} GiB, {arch}{where})"

    def graph_backend(self, device: torch.device) -> HipGraphBackend:
        from radixserve_rocm.graphs import HipGraphBackend  # torch.cuda.CUDAGraph records HIP graphs on ROCm

        return HipGraphBackend(device)

    def profiler_activities(self) -> list[ProfilerActivity]:
        # A ROCm build of torch reports HIP kernels and copies under the CUDA activity.
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
