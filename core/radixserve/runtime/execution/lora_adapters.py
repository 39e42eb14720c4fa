"""The adapters a worker serves (multi-LoRA): loaded to host memory, given a
device slot when a batch needs them, and released when unloaded.

Host memory holds every loaded adapter, this rank's shard of each module
(``--max-loaded-loras`` of them at most). The device holds
``--max-loras-per-batch`` slots in every adapted layer (layers/lora.py); a
step's adapters are put in slots before it runs, and a slot whose adapter no
admitted request uses goes to the next adapter needed, least recently used
first. The scheduler admits a request only while the adapters of the running
requests, with its own, fit the slots (``PrefillPlanner``), so a step always
finds room.

Every load gets an id of its own, which names the adapter's prefix-cache
namespace: a prefix computed under one adapter is never reused for another, nor
for the base model, nor for a later adapter loaded under the same name. An
unloaded adapter takes no new requests; it is dropped (with its cached pages)
once the requests it is serving have finished.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from radixserve.checkpoints.lora import LORA_TARGET_MODULES, AdapterError, AdapterWeights
from radixserve.kernels import NO_ADAPTER, LoRABatch
from radixserve.layers.context import LoRAStep
from radixserve.layers.lora import LoRASlots, attach_lora_slots

logger = logging.getLogger(__name__)


@dataclass
class Adapter:
    id: int
    name: str
    path: str
    rank: int
    parts: dict[str, dict[Any, tuple[torch.Tensor, torch.Tensor]]]  # layer -> shard id -> this rank's (a, b)
    users: int = 0  # requests queued or running with it
    unloading: bool = False

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "rank": self.rank, "id": self.id}


@dataclass
class LoRAAdapters:
    """A model's adapters on one tensor-parallel rank (every rank handles the same
    loads, unloads and steps in the same order, so their slots agree)."""

    step: LoRAStep
    layers: dict[str, LoRASlots]
    targets: dict[str, tuple[str, Any]]  # adapter module name -> (layer, shard id)
    num_slots: int
    max_rank: int
    max_loaded: int | None
    dtype: torch.dtype
    device: torch.device
    by_name: dict[str, Adapter] = field(default_factory=dict)
    _live: dict[int, Adapter] = field(default_factory=dict)  # by id: the loaded ones and those still finishing
    _slot_owner: list[int | None] = field(default_factory=list)
    _recent: OrderedDict[int, None] = field(default_factory=OrderedDict)  # slots, least recently used first
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        step: LoRAStep,
        map_weight_name: Callable[[str], tuple[str, Any] | None],
        num_slots: int,
        max_rank: int,
        max_loaded: int | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> LoRAAdapters:
        """Give ``model``'s adaptable layers their slots."""
        targets = attach_lora_slots(model, step, num_slots, max_rank, map_weight_name)
        layers = {name: model.get_submodule(name).lora for name in {layer for layer, _ in targets.values()}}
        adapters = cls(step, layers, targets, num_slots, max_rank, max_loaded, dtype, device)  # type: ignore[arg-type]
        adapters._slot_owner = [None] * num_slots
        return adapters

    # ---- loading --------------------------------------------------------------------
    def load(self, name: str, path: str) -> Adapter:
        """Read the adapter at ``path`` to host memory as ``name``; an AdapterError names
        the field at fault (a name in use, a rank above the limit, a module the model lacks)."""
        if not name:
            raise AdapterError("lora_name", "must not be empty")
        if name in self.by_name:
            raise AdapterError("lora_name", f"an adapter named {name!r} is loaded already")
        if self.max_loaded is not None and len(self.by_name) >= self.max_loaded:
            raise AdapterError(
                "lora_name", f"{len(self.by_name)} adapters are loaded, --max-loaded-loras is {self.max_loaded}"
            )
        weights = AdapterWeights.read(path, self.dtype)
        rank = weights.config.rank
        if rank > self.max_rank:
            raise AdapterError("lora_path", f"adapter rank {rank} is above --max-lora-rank {self.max_rank}")
        parts: dict[str, dict[Any, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, (a, b) in weights.modules.items():
            if module not in self.targets:
                raise AdapterError("lora_path", _no_target(module))
            layer, shard_id = self.targets[module]
            try:
                a_part, b_part = self.layers[layer].shard(shard_id, a, b)
            except ValueError as exc:
                raise AdapterError("lora_path", f"module {module!r}: {exc}") from exc
            parts.setdefault(layer, {})[shard_id] = (a_part.clone(), b_part.clone())
        adapter = Adapter(next(self._ids), name, path, rank, parts)
        self.by_name[name] = self._live[adapter.id] = adapter
        logger.info("LoRA adapter %r loaded from %s (rank %d, %d modules)", name, path, rank, len(weights.modules))
        return adapter

    def unload(self, name: str) -> int | None:
        """Take ``name`` out of service. Returns its id when nothing uses it (its cache
        namespace can go now); else None, and ``release`` returns the id once its last
        request finishes."""
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise AdapterError("lora_name", f"no adapter named {name!r} is loaded")
        adapter.unloading = True
        return None if adapter.users else self._drop(adapter)

    def resolve(self, name: str, field_name: str = "lora_path") -> Adapter:
        adapter = self.by_name.get(name)
        if adapter is None:
            raise AdapterError(field_name, f"no adapter named {name!r} is loaded (loaded: {sorted(self.by_name)})")
        return adapter

    # ---- requests -------------------------------------------------------------------
    def acquire(self, adapter: Adapter) -> None:
        adapter.users += 1

    def release(self, adapter_id: int) -> int | None:
        """One request of adapter ``adapter_id`` finished; returns the id when that was
        the last request of an unloaded adapter (its cache namespace can go now)."""
        adapter = self._live[adapter_id]
        adapter.users -= 1
        return self._drop(adapter) if adapter.unloading and adapter.users == 0 else None

    def _drop(self, adapter: Adapter) -> int:
        del self._live[adapter.id]
        if adapter.id in self._slot_owner:
            slot = self._slot_owner.index(adapter.id)
            self._slot_owner[slot] = None
            self._recent.pop(slot, None)
        return adapter.id

    # ---- steps ----------------------------------------------------------------------
    def batch(self, adapter_ids: Sequence[int | None], token_counts: Sequence[int], keep: set[int]) -> LoRABatch:
        """The step's LoRA batch for requests using ``adapter_ids`` (None: the base model)
        with ``token_counts`` new tokens each, after putting their adapters in slots;
        a slot is only taken from an adapter not in ``keep`` (those of admitted requests)."""
        needed = {i for i in adapter_ids if i is not None}
        for adapter_id in sorted(needed):
            if adapter_id not in self._slot_owner:
                self._fill(self._free_slot_for(needed | keep), adapter_id)
        slot_of = {owner: slot for slot, owner in enumerate(self._slot_owner) if owner is not None}
        for adapter_id in needed:
            self._recent.move_to_end(slot_of[adapter_id])
        slots = [NO_ADAPTER if i is None else slot_of[i] for i in adapter_ids]
        return LoRABatch.of(token_counts, slots, self.device)

    def _free_slot_for(self, busy: set[int]) -> int:
        for slot, owner in enumerate(self._slot_owner):
            if owner is None:
                return slot
        for slot in self._recent:  # least recently used first
            if self._slot_owner[slot] not in busy:
                return slot
        raise RuntimeError(f"all {self.num_slots} LoRA slots hold adapters of admitted requests")

    def _fill(self, slot: int, adapter_id: int) -> None:
        adapter = self._live[adapter_id]
        for layer_name, layer in self.layers.items():
            layer.write(slot, adapter.parts.get(layer_name, {}))
        self._slot_owner[slot] = adapter_id
        self._recent[slot] = None
        self._recent.move_to_end(slot)

    def describe(self) -> dict[str, Any]:
        resident = {owner for owner in self._slot_owner if owner is not None}
        return {
            "max_loras_per_batch": self.num_slots,
            "max_loaded_loras": self.max_loaded,
            "max_lora_rank": self.max_rank,
            "backend": self.step.backend.name,
            "adapters": [
                {**a.describe(), "in_device_slot": a.id in resident} for a in sorted(self.by_name.values(), key=_name)
            ],
        }


def _name(adapter: Adapter) -> str:
    return adapter.name


def _no_target(module: str) -> str:
    last = module.rpartition(".")[2]
    if last not in LORA_TARGET_MODULES:
        return f"target module {module!r} is not served (LoRA serves {', '.join(LORA_TARGET_MODULES)})"
    return f"target module {module!r}: the model has no such projection"
