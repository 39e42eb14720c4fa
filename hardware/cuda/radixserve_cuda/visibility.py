"""``CUDA_VISIBLE_DEVICES`` as the CUDA runtime reads it, without touching the driver.

The variable is a comma-separated list of device ordinals (``0,2``) or UUIDs
(``GPU-8932f937-...``, prefixes allowed; ``MIG-...`` for MIG instances). The
listed devices become ``cuda:0``, ``cuda:1``, ... in that order. The list ends
at the first entry that is not a valid identifier (so ``0,2,-1,1`` shows 0 and
2, and ``-1`` or an empty value shows nothing); a repeated identifier makes the
whole list invalid (no device). Unset: every device, in the driver's order.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

ENV = "CUDA_VISIBLE_DEVICES"
DeviceId = int | str
_ORDINAL = re.compile(r"\d+")
_UUID_PREFIXES = ("GPU-", "MIG-")


@dataclass(frozen=True)
class VisibleDevices:
    """The devices a visibility variable selects.

    ``ids`` is None when the variable is unset (every device is visible, in the
    driver's order); otherwise the physical ordinals or UUIDs in the order they
    become ``cuda:0``, ``cuda:1``, ...; empty means none is visible.
    """

    variable: str
    value: str | None
    ids: tuple[DeviceId, ...] | None

    @property
    def hides_all(self) -> bool:
        return self.ids == ()

    def physical(self, index: int) -> DeviceId:
        """The physical ordinal or UUID behind logical device ``index``."""
        if self.ids is None:
            return index
        if not 0 <= index < len(self.ids):
            raise IndexError(f"device {index} is not visible ({self.describe()})")
        return self.ids[index]

    def describe(self) -> str:
        if self.value is None:
            return f"{self.variable} is unset: every device is visible"
        return f"{self.variable}={self.value!r}"


def parse_device_list(value: str | None) -> tuple[DeviceId, ...] | None:
    """The identifiers a CUDA-style visibility value selects (None: unset, all visible)."""
    if value is None:
        return None
    ids: list[DeviceId] = []
    for entry in value.split(","):
        entry = entry.strip()
        if _ORDINAL.fullmatch(entry):
            device: DeviceId = int(entry)
        elif entry.startswith(_UUID_PREFIXES) and len(entry) > 4:
            device = entry
        else:
            break  # an invalid entry (a negative ordinal, a typo, an empty value) ends the list
        if device in ids:
            return ()
        ids.append(device)
    return tuple(ids)


def cuda_visible_devices(environ: Mapping[str, str] = os.environ) -> VisibleDevices:
    value = environ.get(ENV)
    return VisibleDevices(ENV, value, parse_device_list(value))
