"""Platforms: what the core knows about a device, reached only through this class."""

from __future__ import annotations

import contextlib
from typing import ClassVar, Iterator

import torch


class Platform:
    """A device kind (``cpu``, ``cuda``, ``rocm``, ``npu``, ...).

    ``unavailable_reasons`` must be cheap and side-effect free: probe with
    ``importlib.util.find_spec`` and environment checks, never by initialising a
    device runtime. ``priority`` orders platforms for ``--device auto``.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    torch_device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    default_dtype: ClassVar[torch.dtype] = torch.bfloat16
    # Share of device memory for weights + KV pool when --mem-fraction-static is not given.
    default_mem_fraction: ClassVar[float] = 0.85
    # Overlap scheduling unless --disable-overlap-schedule says otherwise: it pays
    # where the device computes asynchronously from the host, so the host's work
    # for one step hides behind the device's work for the previous one.
    overlap_schedule: ClassVar[bool] = True

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        return []

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.torch_device_type, index)

    def total_memory_bytes(self, index: int = 0) -> int:
        raise NotImplementedError

    def available_memory_bytes(self, index: int = 0) -> int:
        raise NotImplementedError

    def describe(self, index: int = 0) -> str:
        return self.name

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Wraps every model step (autocast, stream or graph capture hooks)."""
        yield
