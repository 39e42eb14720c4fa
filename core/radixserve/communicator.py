"""The collectives the layers use across the tensor-parallel ranks of one model.

``Platform.communicator(group)`` makes one per rank when the ranks join; the
default runs ``torch.distributed`` on the group (whose backend the platform
named: gloo, nccl, hccl, ...). A plugin may return a subclass with its own
kernels (e.g. a one-shot all-reduce for small messages on GPUs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Communicator:
    """All-reduce and all-gather over ``group``, a torch.distributed process group of ``size`` ranks."""

    def __init__(self, group: dist.ProcessGroup, size: int):
        self.group = group
        self.size = size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank gets the same values."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's ``x`` concatenated along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)
