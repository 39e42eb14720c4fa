"""HIP graphs for radixserve's graph runner, through PyTorch's graph API.

On ROCm builds ``torch.cuda.CUDAGraph`` records and replays HIP graphs (the
same API as on NVIDIA; PyTorch supports capture on ROCm since 5.x). The capture
procedure (device guard for ``--base-gpu-id``, side stream, warm-up runs, one
memory pool shared by every graph) is the core's
:class:`radixserve.platform.StreamGraphBackend`, the same that ``hardware/cuda``
uses. Not yet run on AMD hardware by this project.
"""

from __future__ import annotations

import torch

from radixserve.platform import StreamGraphBackend


class HipGraphBackend(StreamGraphBackend):
    name = "hip_graph"

    def __init__(self, device: torch.device):
        super().__init__(device, torch.cuda, torch.cuda.CUDAGraph)  # HIP graphs on a ROCm build
