"""``triton``: batched LoRA, a shrink and an expand kernel over the batch's runs of one adapter slot (SGMV)."""

from __future__ import annotations

from typing import ClassVar

import torch

from radixserve.kernels import KernelQuery, LoRABackend, LoRABatch
from radixserve_triton._env import device_reasons, dtype_reasons, kernel_module
from radixserve_triton.config import DEFAULT_LORA_CONFIG, LoRAKernelConfig


class TritonLoRA(LoRABackend):
    """One program per block of a run's tokens, so a decode batch of many adapters
    costs two launches however the adapters interleave: a shrink, and an expand over
    every projection of a fused layer (``ops/lora.py``).

    Runs on cuda and rocm; on cpu only under ``TRITON_INTERPRET=1``."""

    name = "triton"
    priority = 10
    # Block sizes and num_warps of both launches; hardware plugins subclass with their own.
    kernel_config: ClassVar[LoRAKernelConfig] = DEFAULT_LORA_CONFIG

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return device_reasons(query) + dtype_reasons(query)

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        self._kernels = kernel_module(query, "triton LoRA", "lora")

    def apply(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        batch: LoRABatch,
        out_splits: tuple[int, ...],
    ) -> None:
        self._kernels.sgmv(x, out, a, b, batch, out_splits, self.kernel_config)
