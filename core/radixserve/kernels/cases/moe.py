"""MoE cases: ``MoECase`` (one MoE layer call) and the inputs it makes
(``make_moe_inputs``, tie-free router logits)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixserve.kernels.moe import MoERouting
from radixserve.kernels.query import KernelQuery


@dataclass(frozen=True)
class MoECase:
    name: str
    num_tokens: int
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    renormalize: bool
    # Group-limited routing and the weights' scale (MoERouting); 1, 1, 1.0: plain top-k.
    num_groups: int = 1
    topk_groups: int = 1
    scaling_factor: float = 1.0

    def routing(self) -> MoERouting:
        return MoERouting(
            top_k=self.top_k,
            renormalize=self.renormalize,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            scaling_factor=self.scaling_factor,
        )

    def query(self, device: str, dtype: torch.dtype) -> KernelQuery:
        return KernelQuery(device=device, dtype=dtype, num_experts=self.num_experts, top_k=self.top_k)


def make_moe_inputs(
    case: MoECase, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, MoERouting]:
    """``(hidden, router_logits, w13, w2, routing)`` on CPU. Router logits are
    distinct multiples of 0.5 per token, exact in every dtype, so top-k has no ties."""
    gen = torch.Generator().manual_seed(seed)
    t, h, i, e = case.num_tokens, case.hidden, case.intermediate, case.num_experts
    hidden = torch.randn((t, h), generator=gen).to(dtype)
    logits = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).float() * 0.5
    logits = (logits - logits.mean(dim=1, keepdim=True).round()).to(dtype)
    w13 = (torch.randn((e, 2 * i, h), generator=gen) / math.sqrt(h)).to(dtype)
    w2 = (torch.randn((e, h, i), generator=gen) / math.sqrt(i)).to(dtype)
    return hidden, logits, w13, w2, case.routing()
