"""Tensor-parallel arithmetic and the two collectives the layers need.

Collectives go through ``ctx.comm``, the ``Communicator`` the platform made
for the TP ranks (runtime/execution/distributed.py), so nothing here is device specific.
With ``tp_size == 1`` they are no-ops.
"""

from __future__ import annotations

import torch

from radixserve.layers.context import ModelContext


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor parallel size {denominator}")
    return numerator // denominator


def all_reduce(x: torch.Tensor, ctx: ModelContext) -> torch.Tensor:
    """Sum ``x`` over the TP ranks (in place when tp_size > 1)."""
    if ctx.tp_size == 1:
        return x
    return ctx.communicator().all_reduce(x)


def all_gather_last_dim(x: torch.Tensor, ctx: ModelContext) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dimension, in rank order."""
    if ctx.tp_size == 1:
        return x
    return ctx.communicator().all_gather(x)
