"""Shared pieces of the weight-loading contract.

Every parameter a model expects from a checkpoint may carry two attributes:

- ``weight_loader(param, loaded, shard_id=None)``: copies a checkpoint tensor
  into it (see :class:`radixserve.kernels.quantization.WeightLoader`);
  parameters without one use :func:`default_weight_loader`.
- ``shard_ids``: the shard ids that together fill it (default ``(None,)``,
  i.e. one whole tensor). The model loader uses it to report missing parts.

The model loader hands the loaders :class:`CheckpointTensor` s, read only where
a loader copies them, so each tensor-parallel rank reads its own shards alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from radixserve.kernels.quantization import WeightLoader


class CheckpointTensor:
    """A checkpoint tensor not read yet (a safetensors slice): ``narrow`` and
    indexing with integers and unit-step slices select a region without reading,
    and ``load()`` reads that region alone, so a tensor-parallel rank reads only
    its own shard of each weight. Weight loaders treat it as a tensor with those
    operations; ``copy_into`` loads it."""

    def __init__(self, source: Any, full_shape: tuple[int, ...], region: tuple[int | slice, ...] | None = None):
        self.source = source  # anything indexable like safetensors' PySafeSlice: source[region] -> tensor
        self.full_shape = tuple(full_shape)
        self.region = region if region is not None else tuple(slice(0, n) for n in self.full_shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(s.stop - s.start for s in self.region if isinstance(s, slice))

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        size = self.shape[dim]
        if not (start >= 0 and length >= 0 and start + length <= size):
            raise ValueError(f"narrow({dim}, {start}, {length}) is outside a dimension of size {size}")
        return self[(slice(None),) * (dim % self.dim()) + (slice(start, start + length),)]

    def __getitem__(self, index: Any) -> CheckpointTensor:
        index = index if isinstance(index, tuple) else (index,)
        open_dims = [(i, s) for i, s in enumerate(self.region) if isinstance(s, slice)]
        if len(index) > len(open_dims):
            raise IndexError(f"too many indices ({len(index)}) for a tensor of {len(open_dims)} dimensions")
        region = list(self.region)
        for (dim, current), item in zip(open_dims, index, strict=False):
            size = current.stop - current.start
            if isinstance(item, int):
                if not -size <= item < size:
                    raise IndexError(f"index {item} is out of range for a dimension of size {size}")
                region[dim] = current.start + item % size
            elif isinstance(item, slice):
                start, stop, step = item.indices(size)
                if step != 1:
                    raise IndexError("checkpoint tensors take unit-step slices only")
                region[dim] = slice(current.start + start, current.start + max(start, stop))
            else:
                raise IndexError(f"checkpoint tensors take integers and slices, got {type(item).__name__}")
        return CheckpointTensor(self.source, self.full_shape, tuple(region))

    def load(self) -> torch.Tensor:
        """Read the selected region (only it) from the checkpoint."""
        tensor: torch.Tensor = self.source[self.region]
        return tensor


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Give ``param`` its ``weight_loader`` (an attribute torch's Parameter does not declare)."""
    _set_attribute(param, "weight_loader", loader)


def set_shard_ids(param: nn.Parameter, shard_ids: tuple[Any, ...]) -> None:
    """Give ``param`` its ``shard_ids``: the shard ids that together fill it."""
    _set_attribute(param, "shard_ids", shard_ids)


def _set_attribute(param: nn.Parameter, name: str, value: object) -> None:
    setattr(param, name, value)


def copy_into(dst: torch.Tensor, src: torch.Tensor | CheckpointTensor, what: str = "weight") -> None:
    """``dst.copy_(src)`` (casting dtype and device) after a loud shape check."""
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src.load() if isinstance(src, CheckpointTensor) else src)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shards, got shard {shard_id!r}")
    copy_into(param.data, loaded)


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not fill the model's parameters one to one."""


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    map_name: Callable[[str], tuple[str, Any] | None],
) -> None:
    """Load checkpoint ``weights`` into ``module``'s parameters.

    ``map_name(checkpoint_name)`` returns ``(parameter_name, shard_id)``, or None
    for a tensor the model deliberately ignores. A tensor that maps to no
    parameter, and a parameter (or shard of one) that no tensor filled, are
    errors, reported together.
    """
    params = dict(module.named_parameters())
    filled: dict[str, set[Any]] = {name: set() for name in params}
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        target = map_name(ckpt_name)
        if target is None:
            continue
        name, shard_id = target
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name if name == ckpt_name else f"{ckpt_name} (as {name})")
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as exc:
            raise CheckpointMismatchError(f"{ckpt_name} -> {name}: {exc}") from exc
        filled[name].add(shard_id)
    missing = []
    for name, param in params.items():
        got = filled[name]
        if None in got:
            continue
        lacking = [s for s in getattr(param, "shard_ids", (None,)) if s not in got]
        if lacking:
            missing.append(name if lacking == [None] else f"{name} shards {lacking}")
    if unexpected or missing:
        raise CheckpointMismatchError(
            "checkpoint does not match the model:"
            + (f"\n  unexpected tensors ({len(unexpected)}): {_head(unexpected)}" if unexpected else "")
            + (f"\n  missing parameters ({len(missing)}): {_head(missing)}" if missing else "")
        )


def _head(names: list[str], n: int = 20) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")
