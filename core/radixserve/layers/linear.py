"""Tensor-parallel linear layers.

Weights are created by ``ctx.quant.create_weights`` and applied by
``ctx.quant.apply``, so a quantization method owns storage and the product; the
layers own only the tensor-parallel split and the checkpoint-to-shard mapping
in their ``weight_loader``. All sizes stored on a layer are this rank's.

- :class:`ColumnParallelLinear`: output features split across ranks.
- :class:`MergedColumnParallelLinear`: several column-parallel projections of the
  same input fused into one (gate and up of an MLP).
- :class:`QKVParallelLinear`: fused q/k/v projection, split by heads; KV heads are
  replicated when there are fewer of them than ranks.
- :class:`RowParallelLinear`: input features split; partial results all-reduced.
- :class:`ReplicatedLinear`: the whole weight on every rank (a small projection
  whose output every rank needs whole: MLA's latent down-projections).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from radixserve.kernels import ElementwiseBackend
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer
from radixserve.layers.parallel import all_reduce, divide
from radixserve.layers.weights import copy_into, set_shard_ids, set_weight_loader


class AdapterUpdate(Protocol):
    """Per-request adapter updates of a layer's output (layers/lora.py's ``LoRASlots``)."""

    @property
    def active(self) -> bool:
        """Whether any token of the step uses an adapter."""
        ...

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...


class LinearBase(Layer):
    """``y = x @ W.T + b`` with W created and applied by the quantization method.

    After the checkpoint is loaded, the model loader calls
    ``self.quant.process_weights_after_loading(self)`` on every instance. With
    LoRA serving, ``lora`` adds each request's adapter update to the output.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ctx: ModelContext,
        bias: bool,
        shard_ids: tuple[Any, ...] = (None,),
    ):
        super().__init__()
        self.lora: AdapterUpdate | None = None  # set for LoRA serving (layers/lora.py)
        self.in_features = in_features
        self.out_features = out_features
        self.ctx = ctx
        self.quant = ctx.quant
        self.quant.create_weights(self, in_features, out_features, ctx.dtype, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=ctx.dtype), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            set_shard_ids(param, shard_ids)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_lora(x, self.quant.apply(self, x, self.bias))

    def _with_lora(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out if self.lora is None else self.lora.add(x, out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, ctx: ModelContext, bias: bool = False):
        super().__init__(in_features, divide(out_features, ctx.tp_size), ctx, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        rows = param.shape[0]
        copy_into(param.data, loaded.narrow(0, self.ctx.tp_rank * rows, rows))


@dataclass(frozen=True)
class _Shard:
    """One checkpoint projection inside a fused column-parallel weight."""

    id: Any
    offset: int  # first row of this shard in this rank's fused weight
    size: int  # rows this rank holds
    full_size: int  # rows of the checkpoint tensor
    source_index: int  # this rank holds rows [source_index * size, +size) of the checkpoint tensor


class FusedColumnLinear(LinearBase):
    """Column-parallel layer whose weight stacks several checkpoint tensors."""

    def __init__(self, in_features: int, shards: Sequence[_Shard], ctx: ModelContext, bias: bool):
        self.shards = tuple(shards)
        self._shard_by_id = {s.id: s for s in self.shards}
        out_features = sum(s.size for s in self.shards)
        super().__init__(in_features, out_features, ctx, bias, shard_ids=tuple(s.id for s in self.shards))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:  # the checkpoint already stores the fused tensor
            total = sum(s.full_size for s in self.shards)
            if loaded.shape[0] != total:
                raise ValueError(f"fused checkpoint tensor has {loaded.shape[0]} rows, expected {total}")
            start = 0
            for part in self.shards:
                self.weight_loader(param, loaded.narrow(0, start, part.full_size), part.id)
                start += part.full_size
            return
        shard = self._shard_by_id.get(shard_id)
        if shard is None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}; shards: {list(self._shard_by_id)}")
        if loaded.shape[0] != shard.full_size:
            raise ValueError(
                f"shard {shard_id!r}: checkpoint tensor has {loaded.shape[0]} rows, expected {shard.full_size}"
            )
        src = loaded.narrow(0, shard.source_index * shard.size, shard.size)
        copy_into(param.data.narrow(0, shard.offset, shard.size), src, f"shard {shard_id!r}")


class MergedColumnParallelLinear(FusedColumnLinear):
    """Projections of sizes ``output_sizes`` fused in order; shard ids are 0, 1, ..."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], ctx: ModelContext, bias: bool = False):
        shards, offset = [], 0
        for i, full in enumerate(output_sizes):
            size = divide(full, ctx.tp_size)
            shards.append(_Shard(i, offset, size, full, ctx.tp_rank))
            offset += size
        super().__init__(in_features, shards, ctx, bias)

    def silu_and_mul(self, x: torch.Tensor, elementwise: ElementwiseBackend) -> torch.Tensor:
        """``silu(gate) * up`` of a (gate, up) projection: one fused kernel where the
        quantization method and GEMM backend have one, else this projection and then
        ``elementwise.silu_and_mul``."""
        adapted = self.lora is not None and self.lora.active
        out = None if adapted else self.quant.apply_silu_and_mul(self, x, self.bias)
        return out if out is not None else elementwise.silu_and_mul(self(x))


class QKVParallelLinear(FusedColumnLinear):
    """Fused q/k/v projection (shard ids ``"q"``, ``"k"``, ``"v"``).

    Each rank holds ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV
    heads; with more ranks than KV heads each KV head is replicated on
    ``tp / num_kv_heads`` consecutive ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        ctx: ModelContext,
        bias: bool = False,
    ):
        tp, rank = ctx.tp_size, ctx.tp_rank
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp)
        if tp >= num_kv_heads:
            replicas = divide(tp, num_kv_heads)
            self.num_kv_heads, kv_index = 1, rank // replicas
        else:
            self.num_kv_heads, kv_index = divide(num_kv_heads, tp), rank
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        shards = [
            _Shard("q", 0, self.q_size, num_heads * head_dim, rank),
            _Shard("k", self.q_size, self.kv_size, num_kv_heads * head_dim, kv_index),
            _Shard("v", self.q_size + self.kv_size, self.kv_size, num_kv_heads * head_dim, kv_index),
        ]
        super().__init__(hidden_size, shards, ctx, bias)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the bias is added once, after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, ctx: ModelContext, bias: bool = False):
        super().__init__(divide(in_features, ctx.tp_size), out_features, ctx, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        if param.dim() == 1:  # bias: replicated
            copy_into(param.data, loaded, "bias")
            return
        cols = param.shape[1]
        copy_into(param.data, loaded.narrow(1, self.ctx.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return self._with_lora(x, self.quant.apply(self, x, self.bias))
        # An adapter's update of this rank's input columns is a partial sum too.
        out = all_reduce(self._with_lora(x, self.quant.apply(self, x, None)), self.ctx)
        return out if self.bias is None else out + self.bias


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, ctx: ModelContext, bias: bool = False):
        super().__init__(in_features, out_features, ctx, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        copy_into(param.data, loaded)


def linear_layers(module: nn.Module) -> list[LinearBase]:
    """Every linear layer in ``module`` (what ``process_weights_after_loading`` visits)."""
    return [m for m in module.modules() if isinstance(m, LinearBase)]


__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "linear_layers",
]
