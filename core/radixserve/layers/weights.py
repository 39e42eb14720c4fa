"""Shared pieces of the weight-loading contract.

Every parameter a model expects from a checkpoint may carry two attributes:

- ``weight_loader(param, loaded, shard_id=None)``: copies a checkpoint tensor
  into it (see :class:`radixserve.kernels.quantization.WeightLoader`);
  parameters without one use :func:`default_weight_loader`.
- ``shard_ids``: the shard ids that together fill it (default ``(None,)``,
  i.e. one whole tensor). The model loader uses it to report missing parts.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn


def copy_into(dst: torch.Tensor, src: torch.Tensor, what: str = "weight") -> None:
    """``dst.copy_(src)`` (casting dtype and device) after a loud shape check."""
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shards, got shard {shard_id!r}")
    copy_into(param.data, loaded)


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not fill the model's parameters one to one."""


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    map_name: Callable[[str], Optional[tuple[str, Any]]],
) -> None:
    """Load checkpoint ``weights`` into ``module``'s parameters.

    ``map_name(checkpoint_name)`` returns ``(parameter_name, shard_id)``, or None
    for a tensor the model deliberately ignores. A tensor that maps to no
    parameter, and a parameter (or shard of one) that no tensor filled, are
    errors, reported together.
    """
    params = dict(module.named_parameters())
    filled: dict[str, set] = {name: set() for name in params}
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
