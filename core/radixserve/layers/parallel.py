"""Tensor-parallel arithmetic and the two collectives the layers need.

Collectives go through ``torch.distributed`` on ``ctx.tp_group``; the platform
chose its backend (gloo, nccl, hccl, ...) when the group was created, so nothing
here is device specific. With ``tp_size == 1`` they are no-ops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from radixserve.layers.context import ModelContext


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor parallel size {denominator}")
    return numerator // denominator


def all_reduce(x: torch.Tensor, ctx: ModelContext) -> torch.Tensor:
    """Sum ``x`` over the TP ranks (in place when tp_size > 1)."""
    if ctx.tp_size > 1:
        dist.all_reduce(x, group=ctx.tp_group)
    return x


def all_gather_last_dim(x: torch.Tensor, ctx: ModelContext) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dimension, in rank order."""
    if ctx.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=ctx.tp_group)
    return torch.cat(parts, dim=-1)
