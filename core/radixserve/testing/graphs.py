"""A stand-in graph backend for machines without one (CI): "capturing" keeps the
callable and "replaying" runs it again, eagerly, writing its result into the
output tensor the capture returned, as a real graph replay rewrites its static
output. Everything around the graph (batch-size table, padding, static
buffers, the attention backend's capture and replay hooks) then runs exactly as
it would with real graphs, so its logic is testable on a CPU.

A platform offers it by returning it from ``graph_backend``, e.g. a test's
subclass of the ``cpu`` platform."""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.platform import DeviceGraph, GraphBackend


class EagerReplayGraph(DeviceGraph):
    def __init__(self, fn: Callable[[], torch.Tensor], output: torch.Tensor, backend: EagerReplayGraphBackend):
        self.fn, self.output, self.backend = fn, output, backend

    def replay(self) -> None:
        self.backend.replays.append(self.output.shape[0])
        self.output.copy_(self.fn())


class EagerReplayGraphBackend(GraphBackend):
    """Records what it captured and replayed, so tests can tell a replayed step from an eager one."""

    name = "eager_replay"

    def __init__(self) -> None:
        self.captured: list[int] = []  # batch size (output rows) of each capture, in order
        self.replays: list[int] = []  # batch size of each replay, in order

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[DeviceGraph, torch.Tensor]:
        output = fn()
        self.captured.append(output.shape[0])
        return EagerReplayGraph(fn, output, self), output
