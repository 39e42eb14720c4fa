"""CUDA graphs for radixserve's graph runner (``radixserve.runtime.graph_runner``).

On ROCm builds of PyTorch ``torch.cuda.CUDAGraph`` records HIP graphs through
the same API, so a ROCm platform plugin can return this backend too.

Every graph of one backend shares one memory pool: the runner captures the
largest batch first, and the smaller graphs reuse its blocks. Capture runs on a
side stream (CUDA forbids capturing on the legacy default stream) after
``WARMUP_RUNS`` eager runs there, which compile Triton kernels and let cuBLAS
and the caching allocator settle before anything is recorded.
"""

from __future__ import annotations

from typing import Callable

import torch

from radixserve.platform import DeviceGraph, GraphBackend

WARMUP_RUNS = 2


class CudaGraph(DeviceGraph):
    def __init__(self, graph: torch.cuda.CUDAGraph):
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphBackend(GraphBackend):
    name = "cuda_graph"

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[DeviceGraph, torch.Tensor]:
        with torch.cuda.device(self.device):  # --base-gpu-id may pick another than the current one
            current = torch.cuda.current_stream()
            self.stream.wait_stream(current)  # the inputs were written on the current stream
            with torch.cuda.stream(self.stream):
                for _ in range(WARMUP_RUNS):
                    fn()
            current.wait_stream(self.stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                output = fn()
            torch.cuda.synchronize()
        return CudaGraph(graph), output
