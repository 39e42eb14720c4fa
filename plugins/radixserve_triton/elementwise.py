"""``triton``: RMSNorm with the residual add fused in, rotary in place on q and
k in one launch, and SiLU-and-mul, each one Triton kernel (ops/elementwise.py);
Gemma's RMSNorm and GELU(tanh)-and-mul on the same kernels."""

from __future__ import annotations

import torch

from radixserve.kernels import MODEL_SPECIFIC_OPS, ElementwiseBackend, KernelQuery, elementwise_op_reasons
from radixserve.kernels.elementwise import NormResult
from radixserve_triton._env import device_reasons, dtype_reasons, kernel_module


class TritonElementwise(ElementwiseBackend):
    """Usable where the Triton attention backend is: cuda and rocm, and cpu
    only under ``TRITON_INTERPRET=1`` (where its priority makes ``auto`` pick it
    over ``torch_native``, as for attention)."""

    name = "triton"
    priority = 10

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return (
            device_reasons(query) + dtype_reasons(query) + elementwise_op_reasons(query, cls.name, MODEL_SPECIFIC_OPS)
        )

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        self._kernels = kernel_module(query, "triton elementwise", "elementwise")

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> NormResult:
        result: NormResult = self._kernels.rms_norm(x, weight, eps, residual)
        return result

    def apply_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        neox_style: bool = True,
    ) -> None:
        self._kernels.apply_rotary(q, k, positions, cos_sin_cache, neox_style)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._kernels.silu_and_mul(x)
        return out

    def gemma_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> NormResult:
        result: NormResult = self._kernels.rms_norm(x, weight, eps, residual, gemma=True)
        return result

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._kernels.gelu_tanh_and_mul(x)
        return out
