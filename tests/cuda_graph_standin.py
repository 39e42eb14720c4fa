"""A stand-in for the stream and graph API of ``torch.cuda`` on a CPU, emulated
from PyTorch's own source (``torch/cuda/__init__.py``, ``torch/cuda/graphs.py``)
so that the device a graph backend works on can be checked without a GPU. It
lives in tests, never in a plugin; :func:`install` puts it in place of the real
functions for one test.

What it keeps of torch's behaviour, and only that:

- one current device per process (0 at start) and one current stream per
  device (its default stream at start);
- ``device(d)`` makes ``d`` current for the block; ``stream(s)`` (torch's
  ``StreamContext``) makes ``s`` the current stream of its device *and* its
  device the current one (``torch.cuda.set_stream`` sets the device too), and
  restores both on exit;
- ``synchronize()`` and ``current_stream()`` without a device act on the current
  device;
- ``graph(g, pool=, stream=)`` on entry synchronises the current device and
  empties the cache, then enters ``stream(stream)`` and begins the capture
  there; on exit it ends the capture and leaves the stream context;
- every call that acts on a device is logged in ``touched``, as (what, device
  index): an untouched device never gets a context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class StandInStream:
    device_index: int
    name: str
    waited_for: list[StandInStream] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def wait_stream(self, other: StandInStream) -> None:
        self.waited_for.append(other)


class StandInCuda:
    def __init__(self, count: int = 2):
        self.count = count
        self.current_device = 0
        self.defaults = [StandInStream(i, f"default:{i}") for i in range(count)]
        self.current = list(self.defaults)  # the current stream of each device
        self.touched: list[tuple[str, int]] = []
        self.graphs: list[StandInGraph] = []
        self.streams: list[StandInStream] = []  # made by Stream(), in order
        self.pools = 0

    # -- devices and streams

    def _index(self, device: Any) -> int:
        if device is None:
            index = self.current_device
        elif isinstance(device, torch.device):
            assert device.type == "cuda", device
            index = self.current_device if device.index is None else device.index
        else:
            index = int(device)
        assert 0 <= index < self.count, f"no cuda:{index}"
        return index

    def _touch(self, what: str, device: Any = None) -> int:
        index = self._index(device)
        self.touched.append((what, index))
        return index

    def device_count(self) -> int:
        return self.count

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        previous, self.current_device = self.current_device, self._index(device)
        try:
            yield
        finally:
            self.current_device = previous

    def set_device(self, device: Any) -> None:
        self.current_device = self._touch("set_device", device)

    def Stream(self, device: Any = None, **_: Any) -> StandInStream:  # torch's name
        index = self._touch("Stream", device)
        self.streams.append(StandInStream(index, f"side:{index}"))
        return self.streams[-1]

    def current_stream(self, device: Any = None) -> StandInStream:
        return self.current[self._touch("current_stream", device)]

    def set_stream(self, stream: StandInStream) -> None:
        self.current_device = stream.device_index  # torch._C._cuda_setStream sets the device too
        self.current[stream.device_index] = stream

    @contextlib.contextmanager
    def stream(self, stream: StandInStream) -> Iterator[None]:
        source_previous = self.current_stream()
        destination_previous = self.current[stream.device_index]
        self.set_stream(stream)
        try:
            yield
        finally:
            self.set_stream(destination_previous)
            self.set_stream(source_previous)

    def synchronize(self, device: Any = None) -> None:
        self._touch("synchronize", device)

    def empty_cache(self) -> None:
        self._touch("empty_cache")

    # -- graphs

    def graph_pool_handle(self) -> tuple[int, int]:
        self.pools += 1
        return (0, self.pools)

    def CUDAGraph(self) -> StandInGraph:  # torch's name
        graph = StandInGraph(self)
        self.graphs.append(graph)
        return graph

    @contextlib.contextmanager
    def graph(self, graph: StandInGraph, pool: Any = None, stream: StandInStream | None = None) -> Iterator[None]:
        self.synchronize()
        self.empty_cache()
        with self.stream(stream if stream is not None else self.Stream()):
            graph.capture_begin(pool)
            try:
                yield
            finally:
                graph.capture_end()

    # -- what the code under test runs on

    def where(self) -> tuple[int, StandInStream]:
        """The current device and its current stream (what a kernel launched now runs on)."""
        return self.current_device, self.current[self.current_device]


class StandInGraph:
    def __init__(self, cuda: StandInCuda):
        self.cuda = cuda
        self.captured_on: tuple[int, StandInStream] | None = None
        self.pool: Any = None
        self.recording = False
        self.replays = 0

    def capture_begin(self, pool: Any = None) -> None:
        self.cuda._touch("capture_begin")
        self.captured_on, self.pool, self.recording = self.cuda.where(), pool, True

    def capture_end(self) -> None:
        self.cuda._touch("capture_end")
        self.recording = False

    def replay(self) -> None:
        assert self.captured_on is not None, "replay of a graph never captured"
        self.replays += 1


NAMES = (
    "device_count",
    "device",
    "set_device",
    "Stream",
    "current_stream",
    "set_stream",
    "stream",
    "synchronize",
    "empty_cache",
    "graph_pool_handle",
    "CUDAGraph",
    "graph",
)


def install(monkeypatch: Any, cuda: StandInCuda) -> StandInCuda:
    """Puts ``cuda``'s functions in place of ``torch.cuda``'s for one test."""
    for name in NAMES:
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    return cuda
