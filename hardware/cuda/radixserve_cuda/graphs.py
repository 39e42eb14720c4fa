"""CUDA graphs for radixserve's graph runner (``radixserve.runtime.execution.graph_runner``).

The capture procedure (device guard for ``--base-gpu-id``, side stream, warm-up
runs, one memory pool shared by every graph) is the core's
:class:`radixserve.platform.StreamGraphBackend`, which ``hardware/rocm``'s HIP
graphs share; this module names the device module it runs on.
"""

from __future__ import annotations

import torch

from radixserve.platform import StreamGraphBackend


class CudaGraphBackend(StreamGraphBackend):
    name = "cuda_graph"

    def __init__(self, device: torch.device):
        super().__init__(device, torch.cuda, torch.cuda.CUDAGraph)
