"""The Ascend NPU platform, reached through torch_npu (the user's CANN-matched install)."""

from __future__ import annotations

import importlib.util
import os

import torch

from radixserve.platform import Platform
from radixserve_npu import ops

VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
TORCH_NPU_MISSING = "torch_npu is not installed (install the torch_npu build matching your CANN toolkit)"


def parse_visible_devices(value: str | None) -> list[int] | None:
    """The physical NPU ids that ``ASCEND_RT_VISIBLE_DEVICES`` exposes, in the order
    the runtime numbers them (logical ``npu:i`` is the ``i``-th); None when the
    variable is unset (every device is visible), ``[]`` when it is set but empty.
    A malformed value is a ``ValueError`` naming the variable."""
    if value is None:
        return None
    if not value.strip():
        return []
    ids: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(
                f"{VISIBLE_DEVICES_ENV}={value!r}: {part!r} is not a device id "
                "(expected comma-separated non-negative integers, e.g. 0,1,3)"
            )
        if int(part) in ids:
            raise ValueError(f"{VISIBLE_DEVICES_ENV}={value!r}: device {int(part)} is listed twice")
        ids.append(int(part))
    return ids


class NpuPlatform(Platform):
    name = "npu"
    priority = 90
    torch_device_type = "npu"
    dist_backend = "hccl"
    default_dtype = torch.bfloat16
    # Graph mode stays off: ``graph_backend`` is the base class's None, so every
    # step runs eagerly (torch_npu's graph modes are not wired in).

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        if importlib.util.find_spec("torch_npu") is None:
            return [TORCH_NPU_MISSING]
        try:
            visible = parse_visible_devices(os.environ.get(VISIBLE_DEVICES_ENV))
        except ValueError as exc:
            return [str(exc)]
        if visible == []:
            return [f"{VISIBLE_DEVICES_ENV} is set but empty, so no NPU is visible"]
        try:
            count = ops.load_torch_npu().npu.device_count()
        except Exception as exc:  # a torch_npu that does not match torch or CANN fails here
            return [f"torch_npu failed to load: {type(exc).__name__}: {exc}"]
        if count == 0:
            return [f"no Ascend NPU is visible (check the driver with npu-smi info, and {VISIBLE_DEVICES_ENV})"]
        return []

    def total_memory_bytes(self, index: int = 0) -> int:
        total: int = ops.load_torch_npu().npu.mem_get_info(index)[1]
        return total

    def available_memory_bytes(self, index: int = 0) -> int:
        free: int = ops.load_torch_npu().npu.mem_get_info(index)[0]
        return free

    def bind_device(self, device: torch.device) -> None:
        ops.load_torch_npu().npu.set_device(device)

    def synchronize(self, device: torch.device) -> None:
        ops.load_torch_npu().npu.synchronize(device)

    def describe(self, index: int = 0) -> str:
        npu = ops.load_torch_npu().npu
        total = npu.mem_get_info(index)[1]
        visible = parse_visible_devices(os.environ.get(VISIBLE_DEVICES_ENV))
        physical = f", physical device {visible[index]}" if visible else ""
        return f"npu:{index} {npu.get_device_name(index)} ({total / 2**30:.0f} GiB{physical})"
