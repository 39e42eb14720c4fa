"""HIP graphs for radixserve's graph runner, through PyTorch's graph API.

On ROCm builds ``torch.cuda.CUDAGraph`` records and replays HIP graphs (the
same API as on NVIDIA; PyTorch supports capture on ROCm since 5.x). All graphs
of one backend share one memory pool (the runner captures the largest batch
first). Each capture runs on a side stream, after warm-up runs there that
compile the Triton kernels and settle the allocator, since neither may happen
while a graph records. Not yet run on AMD hardware by this project.
"""

from __future__ import annotations

from typing import Callable

import torch

from radixserve.platform import DeviceGraph, GraphBackend

WARMUP_RUNS = 2


class HipGraph(DeviceGraph):
    def __init__(self, graph: "torch.cuda.CUDAGraph"):
        self._graph = graph

    def replay(self) -> None:
        self._graph.replay()


class HipGraphBackend(GraphBackend):
    name = "hip_graph"

    def __init__(self, device: torch.device):
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[DeviceGraph, torch.Tensor]:
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs were written there
        with torch.cuda.stream(self._stream):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            output = fn()
        torch.cuda.synchronize(self.device)
        return HipGraph(graph), output
