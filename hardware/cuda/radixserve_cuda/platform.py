"""The ``cuda`` platform: probing, device selection, memory and description.

Probing never creates a CUDA context: ``unavailable_reasons`` runs in the server
process and in ``radixserve plugins``, which then spawn (never fork) the
scheduler. ``torch.cuda.device_count()`` counts through NVML (libnvidia-ml)
before CUDA is initialised, honouring ``CUDA_VISIBLE_DEVICES``; only where NVML
cannot answer (no libnvidia-ml, MIG UUIDs) does torch fall back to
``cudaGetDeviceCount``, which initialises the driver but creates no context.
Everything that needs the device (memory, properties) runs in the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.profiler import ProfilerActivity

from radixserve.platform import Platform
from radixserve_cuda.visibility import VisibleDevices, cuda_visible_devices

if TYPE_CHECKING:
    from radixserve_cuda.graphs import CudaGraphBackend


def reusable_free_bytes(free: int, reserved: int, allocated: int) -> int:
    """What this process can still allocate: the driver's free memory plus the
    blocks torch's caching allocator holds without using (temporaries of the
    weight loading, kept for reuse, are not in the driver's free count)."""
    return free + max(0, reserved - allocated)


def visible_device_reasons(visible: VisibleDevices, count: int) -> list[str]:
    """Why no device can be used, from the visibility variable and the device count."""
    if visible.hides_all:
        return [f"no CUDA device is visible: {visible.describe()} selects none"]
    if count == 0:
        return ["no CUDA device is visible (check the NVIDIA driver with nvidia-smi, and CUDA_VISIBLE_DEVICES)"]
    return []


class CudaPlatform(Platform):
    """NVIDIA GPUs. Device ``index`` is ``cuda:index`` in the visible order;
    the model runner asks for ``--base-gpu-id + tp_rank``."""

    name = "cuda"
    priority = 100
    torch_device_type = "cuda"
    dist_backend = "nccl"
    default_dtype = torch.bfloat16
    pinned_host_staging = True

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        if getattr(torch.version, "cuda", None) is None:
            reason = f"torch {torch.__version__} is not a CUDA build"
            if getattr(torch.version, "hip", None):
                reason += " (it is a ROCm build: install radixserve-plugin-rocm and use --device rocm)"
            return [reason]
        visible = cuda_visible_devices()
        count = 0 if visible.hides_all else torch.cuda.device_count()
        return visible_device_reasons(visible, count)

    def device(self, index: int = 0) -> torch.device:
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ValueError(
                f"base_gpu_id: cuda:{index} does not exist: {count} device(s) are visible "
                f"({cuda_visible_devices().describe()})"
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
        visible = cuda_visible_devices()
        where = "" if visible.ids is None else f", physical {visible.physical(index)}"
        return f"cuda:{index} {props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}{where})"

    def graph_backend(self, device: torch.device) -> CudaGraphBackend:
        from radixserve_cuda.graphs import CudaGraphBackend  # CUDA graphs: radixserve_cuda/graphs.py

        return CudaGraphBackend(device)

    def profiler_activities(self) -> list[ProfilerActivity]:
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]  # CUDA: kernels and copies through CUPTI
