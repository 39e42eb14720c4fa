"""What a model is built with: the selected backends and its parallel rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from radixserve.communicator import Communicator
from radixserve.kernels import (
    AttentionBackend,
    ElementwiseBackend,
    GemmBackend,
    KernelQuery,
    LoRABackend,
    LoRABatch,
    MoEBackend,
    QuantizationMethod,
)


class BackendSelector(Protocol):
    def select(self, kind: str, query: KernelQuery, requested: str = "auto") -> type:
        """The backend class of ``kind`` for ``query``: ``requested`` names one, or is ``auto``."""
        ...


@dataclass
class LoRAStep:
    """What every LoRA layer of a model reads in a forward (layers/lora.py): the
    backend, and the step's batch, which the model runner sets before each forward
    (None, or a batch with no segments: no token uses an adapter)."""

    backend: LoRABackend
    batch: LoRABatch | None = None

    @property
    def active(self) -> bool:
        return self.batch is not None and bool(self.batch.segments)


@dataclass
class ModelContext:
    attention: AttentionBackend
    gemm: GemmBackend
    quant: QuantizationMethod
    moe: MoEBackend | None
    elementwise: ElementwiseBackend  # norms, rotary, the MLP activation
    dtype: torch.dtype
    device: torch.device
    tp_rank: int = 0
    tp_size: int = 1
    # The collectives across the TP ranks (the platform's); None when tp_size is 1,
    # or while a model is only built and loaded (no forward).
    comm: Communicator | None = None
    # LoRA serving (the query's max_lora_rank is set): the adapter layers' backend and step.
    lora: LoRAStep | None = None

    @classmethod
    def create(
        cls,
        selector: BackendSelector,
        query: KernelQuery,
        device: torch.device,
        *,
        attention: str = "auto",
        gemm: str = "auto",
        moe: str = "auto",
        elementwise: str = "auto",
        lora: str = "auto",
        quantization: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        comm: Communicator | None = None,
    ) -> ModelContext:
        """Select and instantiate every backend for ``query`` through ``selector``
        (a :class:`radixserve.registry.PluginRegistry`, which selects by priority,
        or a :class:`radixserve.backend_timing.MeasuredSelection`). The MoE backend
        is only selected when the query names experts, the LoRA backend when it has a
        ``max_lora_rank``; ``quantization=None`` means ``none``."""
        gemm_backend = selector.select("gemm", query, gemm)(query)
        quant_cls = selector.select("quantization", query, quantization or "none")
        moe_backend = selector.select("moe", query, moe)(query) if query.num_experts else None
        lora_step = LoRAStep(selector.select("lora", query, lora)(query)) if query.max_lora_rank else None
        return cls(
            attention=selector.select("attention", query, attention)(query),
            gemm=gemm_backend,
            quant=quant_cls(query, gemm_backend),
            moe=moe_backend,
            elementwise=selector.select("elementwise", query, elementwise)(query),
            dtype=query.dtype,
            device=device,
            tp_rank=tp_rank,
            tp_size=tp_size,
            comm=comm,
            lora=lora_step,
        )

    def communicator(self) -> Communicator:
        """``comm``, which a forward at tp_size > 1 needs."""
        if self.comm is None:
            raise RuntimeError(f"tp_size is {self.tp_size} but the ModelContext has no communicator")
        return self.comm
