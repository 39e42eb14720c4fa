from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.kernels import KernelQuery, MoEBackend, MoERouting, route


class TorchNativeMoE(MoEBackend):
    """Loops over the experts that received tokens; exact reference semantics."""

    name = "torch_native"
    priority = 0

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return []

    def graph_unsupported_reasons(self) -> list[str]:
        return [f"moe backend {self.name!r} loops on the host over the experts that received tokens"]

    def forward(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        routing: MoERouting,
    ) -> torch.Tensor:
        weights, ids = route(router_logits, routing)
        out = torch.zeros_like(hidden, dtype=torch.float32)
        inter = w2.shape[2]
        for expert in torch.unique(ids).tolist():
            token_idx, slot = torch.nonzero(ids == expert, as_tuple=True)
            x = hidden[token_idx]
            gate_up = F.linear(x, w13[expert])
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            y = F.linear(act, w2[expert])
            out.index_add_(0, token_idx, y.float() * weights[token_idx, slot, None])
        return out.to(hidden.dtype)
