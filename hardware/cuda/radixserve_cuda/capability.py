"""Compute capability of the visible devices, read without creating a CUDA context.

Backend selection asks for it in processes that must not hold a context (the
server process, ``radixserve plugins``), so NVML (libnvidia-ml, through ctypes)
answers first. Where NVML cannot (no library, MIG or abbreviated UUIDs in
``CUDA_VISIBLE_DEVICES``), or CUDA is already initialised in this process, torch
does (``get_device_capability`` initialises the CUDA runtime of this process).
"""

from __future__ import annotations

import ctypes

import torch

from radixserve_cuda.visibility import VisibleDevices, cuda_visible_devices

Capability = tuple[int, int]


def _nvml_capabilities(visible: VisibleDevices) -> list[Capability] | None:
    """Capabilities of the visible devices through NVML, or None when NVML cannot tell."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        ids = visible.ids
        if ids is None:
            count = ctypes.c_uint()
            if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
                return None
            ids = tuple(range(count.value))
        caps = []
        for device in ids:
            handle = ctypes.c_void_p()
            if isinstance(device, int):
                rc = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(device), ctypes.byref(handle))
            elif device.startswith("GPU-"):
                rc = nvml.nvmlDeviceGetHandleByUUID(device.encode(), ctypes.byref(handle))
            else:
                return None
            major, minor = ctypes.c_int(), ctypes.c_int()
            if rc != 0 or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)):
                return None
            caps.append((major.value, minor.value))
        return caps
    finally:
        nvml.nvmlShutdown()


def visible_capabilities() -> list[Capability]:
    """``(major, minor)`` of every visible device (empty on a machine without one)."""
    if getattr(torch.version, "cuda", None) is None:
        return []
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # unannotated in torch
        caps = _nvml_capabilities(cuda_visible_devices())
        if caps is not None:
            return caps
    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def capability_reasons(caps: list[Capability], minimum: Capability, what: str) -> list[str]:
    """Why ``what`` cannot run on these devices: none visible, or one below ``minimum``."""
    need = f"compute capability >= {minimum[0]}.{minimum[1]}"
    if not caps:
        return [f"{what} needs a CUDA device of {need}; none is visible"]
    low = [f"cuda:{i} is {major}.{minor}" for i, (major, minor) in enumerate(caps) if (major, minor) < minimum]
    if low:
        return [f"{what} needs {need} (Ada, Hopper or newer); {', '.join(low)}"]
    return []
