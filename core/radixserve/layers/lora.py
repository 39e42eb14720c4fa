"""LoRA adapters on the linear layers: each layer an adapter may target holds
``num_slots`` slots of stacked A and B matrices (kernels/lora.py), and adds the
update of each token's slot to its output through the selected LoRA backend.

PEFT names an adapter's modules as the checkpoint names the base projections
(``q_proj``, ``gate_proj``, ...); the model's own ``map_weight_name`` says which
layer, and which shard of a fused layer, each one is. Projection ``j`` of a
layer has rows ``[j * max_rank, (j + 1) * max_rank)`` of the slot's A and its own
output rows of B (kernels/lora.py); an adapter of smaller rank is padded with
zeros. Under tensor parallelism an adapter is cut as its base layer is:
a column-parallel projection keeps this rank's rows of B (and all of A), a
row-parallel one this rank's columns of A (and all of B), whose partial update
joins the base output's partial sum before the all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.checkpoints.lora import LORA_TARGET_MODULES
from radixserve.layers.context import LoRAStep
from radixserve.layers.linear import (
    ColumnParallelLinear,
    FusedColumnLinear,
    LinearBase,
    ReplicatedLinear,
    RowParallelLinear,
)


@dataclass(frozen=True)
class LoRAProjection:
    """One projection of a layer an adapter may target: this rank's output rows
    ``[out_offset, out_offset + out_size)`` of the layer are rows
    ``[source_row, source_row + out_size)`` of the adapter's B; ``a_columns``
    ``(start, count)`` is this rank's slice of A's input columns (None: all)."""

    shard_id: Any
    out_offset: int
    out_size: int
    source_row: int
    full_out: int
    full_in: int
    a_columns: tuple[int, int] | None = None


def projections_of(layer: LinearBase) -> dict[Any, LoRAProjection]:
    """The projections of ``layer`` by shard id (None for an unfused layer)."""
    ctx, full_in = layer.ctx, layer.in_features
    if isinstance(layer, FusedColumnLinear):
        return {
            s.id: LoRAProjection(s.id, s.offset, s.size, s.source_index * s.size, s.full_size, full_in)
            for s in layer.shards
        }
    out = layer.out_features
    if isinstance(layer, ColumnParallelLinear):
        return {None: LoRAProjection(None, 0, out, ctx.tp_rank * out, out * ctx.tp_size, full_in)}
    if isinstance(layer, RowParallelLinear):
        cols = layer.in_features
        return {None: LoRAProjection(None, 0, out, 0, out, cols * ctx.tp_size, (ctx.tp_rank * cols, cols))}
    if isinstance(layer, ReplicatedLinear):
        return {None: LoRAProjection(None, 0, out, 0, out, full_in)}
    raise TypeError(f"{type(layer).__name__} has no LoRA layout")


class LoRASlots(nn.Module):
    """One layer's adapter slots: ``a`` ``[slots, len(projections) * max_rank, in]``,
    ``b`` ``[slots, out, max_rank]`` (kept as buffers, not parameters: no checkpoint
    fills them); ``out_splits`` the projections' output rows, in order."""

    def __init__(self, layer: LinearBase, step: LoRAStep, num_slots: int, max_rank: int):
        super().__init__()
        self.step = step
        self.max_rank = max_rank
        self.projections = projections_of(layer)
        self.rank_offset = {sid: j * max_rank for j, sid in enumerate(self.projections)}
        self.out_splits = tuple(p.out_size for p in self.projections.values())
        k = len(self.projections) * max_rank
        kw: dict[str, Any] = {"dtype": layer.ctx.dtype, "device": layer.ctx.device}
        self.a: torch.Tensor
        self.b: torch.Tensor
        self.register_buffer("a", torch.zeros((num_slots, k, layer.in_features), **kw), persistent=False)
        self.register_buffer("b", torch.zeros((num_slots, layer.out_features, max_rank), **kw), persistent=False)

    @property
    def active(self) -> bool:
        return self.step.active

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` with the step's adapter updates added (in place)."""
        if self.step.active:
            batch = self.step.batch
            assert batch is not None  # active
            flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
            self.step.backend.apply(flat_x, flat_out, self.a, self.b, batch, self.out_splits)
        return out

    def shard(self, shard_id: Any, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of one projection's full ``a`` ``[r, in]`` and ``b`` ``[out, r]``."""
        p = self.projections[shard_id]
        if b.shape[0] != p.full_out or a.shape[1] != p.full_in:
            raise ValueError(
                f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a projection of "
                f"{p.full_in} inputs and {p.full_out} outputs"
            )
        if p.a_columns is not None:
            a = a.narrow(1, *p.a_columns)
        return a, b.narrow(0, p.source_row, p.out_size)

    def write(self, slot: int, parts: dict[Any, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill ``slot`` with an adapter's ``(a, b)`` per projection (this rank's
        shards, scaling folded into b); projections it leaves out stay zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for shard_id, (a, b) in parts.items():
            p, start = self.projections[shard_id], self.rank_offset[shard_id]
            r = a.shape[0]
            self.a[slot, start : start + r].copy_(a, non_blocking=True)
            self.b[slot, p.out_offset : p.out_offset + p.out_size, :r].copy_(b, non_blocking=True)


def target_layers(
    model: nn.Module, map_weight_name: Callable[[str], tuple[str, Any] | None]
) -> dict[str, tuple[str, Any]]:
    """Every adapter module name the model has (``model.layers.0.self_attn.q_proj``) ->
    ``(layer name, shard id)``, found through the model's own checkpoint mapping."""
    found: dict[str, tuple[str, Any]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        parent, _, _ = name.rpartition(".")
        for target in LORA_TARGET_MODULES:
            peft_name = f"{parent}.{target}" if parent else target
            mapped = map_weight_name(f"{peft_name}.weight")
            if mapped is not None and mapped[0] == f"{name}.weight":
                found[peft_name] = (name, mapped[1])
    return found


def attach_lora_slots(
    model: nn.Module,
    step: LoRAStep,
    num_slots: int,
    max_rank: int,
    map_weight_name: Callable[[str], tuple[str, Any] | None],
) -> dict[str, tuple[str, Any]]:
    """Give every layer an adapter may target its slots; returns ``target_layers``."""
    targets = target_layers(model, map_weight_name)
    for layer_name in sorted({layer for layer, _ in targets.values()}):
        layer = model.get_submodule(layer_name)
        assert isinstance(layer, LinearBase)
        layer.lora = LoRASlots(layer, step, num_slots, max_rank)
    return targets
