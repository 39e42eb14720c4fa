"""GEMM backends in PyTorch: ``torch`` (``F.linear``, any device, the reference)
and ``onednn`` (CPU: weights packed once at load time into oneDNN's blocked
layout, so no call reorders them again).

``F.linear`` on a bf16 CPU tensor already runs oneDNN, but it reorders the
weight on every call; at decode sizes that reorder costs as much as the
product (see docs/benchmarks.md, P5). In float32 ``F.linear`` runs MKL's sgemm,
and oneDNN on a packed weight is faster at every size measured.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from radixserve.kernels import GemmBackend, KernelQuery


class TorchGemm(GemmBackend):
    name = "torch"
    priority = 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return F.linear(x, weight, bias)


ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


class OneDnnGemm(GemmBackend):
    """``torch.ops.mkldnn._linear_pointwise`` on weights packed by
    ``torch.ops.mkldnn._reorder_linear_weight``.

    Dense weights (a quantization method's dequantized ones) take the same
    oneDNN product, which gives bit-identical results to the packed weight,
    so a quantized model and its dequantized reference agree exactly.
    """

    name = "onednn"
    priority = 10  # ahead of ``torch`` wherever it applies

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        reasons = []
        if query.device != "cpu":
            reasons.append(f"runs on cpu only, not {query.device!r}")
        if query.dtype not in ONEDNN_DTYPES:
            reasons.append(f"dtype {query.dtype} is not float32 or bfloat16")
        if not torch.backends.mkldnn.is_available():
            reasons.append("this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)")
        elif query.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            reasons.append("this CPU lacks the AVX-512 oneDNN needs for bfloat16")
        return reasons

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        # The batch-size hint only guides oneDNN's choice of layout; a packed
        # weight serves every batch size (hints 1, 32 and 512 showed no consistent difference).
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
