"""Which GPUs a ROCm process sees, from its environment, without touching the driver.

Two layers select devices. ``ROCR_VISIBLE_DEVICES`` is applied first, by the
ROCr runtime, to the physical devices; ``HIP_VISIBLE_DEVICES`` (or, when it is
unset, ``CUDA_VISIBLE_DEVICES``, which HIP honours for compatibility) then picks
among the devices ROCr left, by their position there. Each is a comma-separated
list of ordinals or ``GPU-`` UUIDs that ends at the first invalid entry (``-1``,
an empty value: nothing); a repeated entry selects nothing. The surviving
devices become ``cuda:0``, ``cuda:1``, ... in torch (``--device rocm``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

ROCR_ENV = "ROCR_VISIBLE_DEVICES"
HIP_ENVS = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")  # the first one set applies
DeviceId = int | str
_ORDINAL = re.compile(r"\d+")


def parse_device_list(value: str | None) -> tuple[DeviceId, ...] | None:
    """The ordinals or UUIDs one variable lists (None: unset, no restriction)."""
    if value is None:
        return None
    ids: list[DeviceId] = []
    for entry in value.split(","):
        entry = entry.strip()
        if _ORDINAL.fullmatch(entry):
            device: DeviceId = int(entry)
        elif entry.startswith("GPU-") and len(entry) > 4:
            device = entry
        else:
            break  # an invalid entry (a negative ordinal, a typo, an empty value) ends the list
        if device in ids:
            return ()
        ids.append(device)
    return tuple(ids)


def compose(rocr: tuple[DeviceId, ...] | None, hip: tuple[DeviceId, ...] | None) -> tuple[DeviceId, ...] | None:
    """HIP's selection applied to what ROCr left: an ordinal indexes ROCr's list (one past
    its end ends the selection); a UUID names a physical device directly."""
    if hip is None or rocr is None:
        return rocr if hip is None else hip
    out: list[DeviceId] = []
    for device in hip:
        if isinstance(device, str):
            out.append(device)
        elif device < len(rocr):
            out.append(rocr[device])
        else:
            break
    return tuple(out)


@dataclass(frozen=True)
class RocmVisibleDevices:
    """``ids``: the physical ordinals or UUIDs behind ``cuda:0``, ``cuda:1``, ...
    (None: no variable restricts them; empty: none is visible)."""

    settings: tuple[tuple[str, str], ...]  # the variables that apply, with their values
    ids: tuple[DeviceId, ...] | None

    @property
    def hides_all(self) -> bool:
        return self.ids == ()

    def physical(self, index: int) -> DeviceId:
        if self.ids is None:
            return index
        if not 0 <= index < len(self.ids):
            raise IndexError(f"device {index} is not visible ({self.describe()})")
        return self.ids[index]

    def describe(self) -> str:
        if not self.settings:
            return "no visibility variable is set: every device is visible"
        return ", ".join(f"{name}={value!r}" for name, value in self.settings)


def rocm_visible_devices(environ: Mapping[str, str] = os.environ) -> RocmVisibleDevices:
    settings = []
    rocr = parse_device_list(environ.get(ROCR_ENV))
    if rocr is not None:
        settings.append((ROCR_ENV, environ[ROCR_ENV]))
    hip_env = next((name for name in HIP_ENVS if name in environ), None)
    hip = None
    if hip_env is not None:
        hip = parse_device_list(environ[hip_env])
        settings.append((hip_env, environ[hip_env]))
    return RocmVisibleDevices(tuple(settings), compose(rocr, hip))
