"""``triton``: fused MoE (sorted, block-aligned grouped GEMMs with SiLU gating)."""

from __future__ import annotations

from typing import ClassVar

import torch

from radixserve.kernels import KernelQuery, MoEBackend, MoERouting, route
from radixserve_triton._env import device_reasons, dtype_reasons, kernel_module
from radixserve_triton.config import DEFAULT_MOE_CONFIG, MoEKernelConfig


class TritonMoE(MoEBackend):
    """Routing through ``radixserve.kernels.route`` (the shared semantics), then
    two Triton grouped GEMMs over the tokens sorted by expert.

    Runs on cuda and rocm; on cpu only under ``TRITON_INTERPRET=1``."""

    name = "triton"
    priority = 10
    # Block sizes and num_warps of every launch; hardware plugins subclass with their own.
    kernel_config: ClassVar[MoEKernelConfig] = DEFAULT_MOE_CONFIG

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        reasons = device_reasons(query) + dtype_reasons(query)
        if query.num_experts is not None and query.top_k is not None and query.top_k > query.num_experts:
            reasons.append(f"top_k {query.top_k} exceeds num_experts {query.num_experts}")
        if query.quantization not in (None, "none"):
            reasons.append(f"quantized expert weights ({query.quantization}) are not supported")
        return reasons

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        self._kernels = kernel_module(query, "triton MoE", "moe")

    def forward(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        routing: MoERouting,
    ) -> torch.Tensor:
        weights, ids = route(router_logits, routing)
        out: torch.Tensor = self._kernels.fused_moe(hidden, w13, w2, weights, ids, self.kernel_config)
        return out
