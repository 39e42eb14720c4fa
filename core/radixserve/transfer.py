"""The small host <-> device copies of every step, made so they never stall the host.

A step sends a few short lists to the device (request rows, lengths, KV slots)
and brings its sampled tokens back. On a device that computes asynchronously
from the host, a copy from ordinary (pageable) host memory makes the host wait
until the device has drained its queue, and so does reading a result with
``.tolist()``; either one undoes overlap scheduling, where the host prepares
step N+1 while the device still computes step N.

Where the platform says so (``Platform.pinned_host_staging``), lists go to the
device through page-locked host memory with asynchronous copies (torch's host
allocator keeps each staging block alive until its copy has run), and results
come back the same way, into page-locked buffers that are read once an event
recorded after the copy has passed. Elsewhere (the CPU, where the "device" is
the host) the same calls are plain synchronous copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostCopy:
    """Host copies of some device tensors, started by ``HostTransfer.to_host``."""

    def __init__(self, tensors: list[torch.Tensor], event: torch.Event | None):
        self._tensors, self._event = tensors, event

    def ready(self) -> bool:
        """Whether the copies have landed (never waits)."""
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once the copies have landed. A device error of the work
        queued before the copies surfaces here."""
        if self._event is not None:
            self._event.synchronize()
        return self._tensors


class HostTransfer:
    """Host <-> device copies for one device (see the module docstring)."""

    def __init__(self, device: torch.device, pinned_staging: bool = False):
        self.device = device
        self.pinned_staging = pinned_staging

    def to_device(self, values: Sequence[float], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``torch.tensor(values, dtype=dtype)`` on the device, without waiting for it."""
        if not self.pinned_staging:
            return torch.tensor(values, dtype=dtype, device=self.device)
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def to_host(self, *tensors: torch.Tensor) -> HostCopy:
        """Start copying ``tensors`` to the host, after the work queued so far."""
        if not self.pinned_staging:
            return HostCopy([t.cpu() for t in tensors], None)
        hosts = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            hosts.append(host)
        event = torch.Event(device=self.device)
        event.record()
        return HostCopy(hosts, event)
