"""Mixture-of-experts: top-k routing over SiLU-gated experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.kernels.base import Backend
from radixserve.kernels.query import KernelQuery


@dataclass(frozen=True)
class MoERouting:
    top_k: int
    renormalize: bool  # divide the top-k weights by their sum
    scoring: str = "softmax"  # softmax over all experts, then top-k
    # Group-limited routing (DeepSeek-V2's "group_limited_greedy"): the experts form
    # num_groups equal groups in order, each group scores as its best expert, and the
    # top-k experts are taken from the topk_groups best groups only. 1: no groups.
    num_groups: int = 1
    topk_groups: int = 1
    # Every chosen expert's weight is multiplied by this (after any renormalization).
    scaling_factor: float = 1.0


class MoEBackend(Backend):
    """``forward`` returns ``sum_k w_k * W2_e (silu(W1_e x) * W3_e x)`` over the
    top-k experts ``e`` of each token.

    Shapes: hidden ``[T, H]``, router_logits ``[T, E]``, w13 ``[E, 2*I, H]`` (gate
    rows first, then up rows), w2 ``[E, H, I]``.
    """

    def __init__(self, query: KernelQuery):
        self.query = query

    def forward(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        routing: MoERouting,
    ) -> torch.Tensor:
        raise NotImplementedError

    def graph_unsupported_reasons(self) -> list[str]:
        """Why a decode step through this backend cannot be captured in a device
        graph (empty: it can). A backend whose ``forward`` reads device values on
        the host (a loop over the experts that received tokens, say) must answer
        with a reason: capture would fail, or freeze one batch's routing."""
        return []


def route(router_logits: torch.Tensor, routing: MoERouting) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert weights ``[T, k]`` (float32) and ids ``[T, k]``; shared by backends."""
    if routing.scoring != "softmax":
        raise ValueError(f"unknown MoE scoring function {routing.scoring!r}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    if routing.num_groups > 1:
        tokens, experts = probs.shape
        group_best = probs.view(tokens, routing.num_groups, -1).amax(dim=-1)  # [T, groups]
        chosen = torch.topk(group_best, routing.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_best, dtype=torch.bool).scatter_(1, chosen, True)
        probs = probs.masked_fill(~keep.repeat_interleave(experts // routing.num_groups, dim=1), 0.0)
    weights, ids = torch.topk(probs, routing.top_k, dim=-1)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing.scaling_factor != 1.0:
        weights = weights * routing.scaling_factor
    return weights, ids
