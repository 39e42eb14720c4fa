"""``example_gemm``: ``y = x @ W.T + b`` accumulated in float32."""

from __future__ import annotations

import torch

from radixserve.kernels import GemmBackend, KernelQuery


class ExampleGemm(GemmBackend):
    name = "example_gemm"
    priority = -10  # only when asked for by name

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        if query.device not in ("cpu", "cuda"):
            return [f"device {query.device!r} is not cpu or cuda"]
        return []

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.matmul(x.float(), weight.float().t())
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
