"""``npu_grouped``: MoE experts through ``torch_npu.npu_grouped_matmul``.

Routing is the core's ``route`` (softmax, top-k, optional renormalisation), so
every backend routes alike. The token-expert pairs are sorted by expert, and
each projection is one grouped matmul over them: a single ``x`` ``[M, K]``, a
single ``weight`` ``[E, K, N]`` (the checkpoint's ``[E, N, K]`` transposed, a
view the operator accepts), ``group_list`` the cumulative row counts
(``group_list_type=0``), ``group_type=0`` (grouped along M), ``split_item=2``
(one output tensor). The gated SiLU and the weighted sum back to the tokens are
torch ops.

Routed by the operator's availability: a torch_npu build without
``npu_grouped_matmul`` runs the same sorted pairs through a torch loop over the
experts (the reference semantics), checked once per backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixserve.kernels import KernelQuery, MoEBackend, MoERouting, route
from radixserve_npu import ops

# (x [M, K], weight [E, K, N], group_list [E]) -> [M, N]
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

MAX_GROUPS = 1024  # group_list of the single-tensor form holds at most 1024 experts
MOE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def grouped_matmul_torch(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """What ``npu_grouped_matmul`` computes here, in torch: rows ``group_list[e-1] ..
    group_list[e]`` of ``x`` times ``weight[e]``."""
    out = x.new_empty(x.shape[0], weight.shape[2])
    bounds = [0, *group_list.tolist()]
    for e in range(weight.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = x[lo:hi] @ weight[e]
    return out


class NpuGroupedMoE(MoEBackend):
    name = "npu_grouped"
    priority = 20
    devices: tuple[str, ...] = ("npu",)

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        reasons = []
        if query.device not in cls.devices:
            reasons.append(f"runs on the npu platform only, not {query.device}")
        if query.dtype not in MOE_DTYPES:
            reasons.append(f"dtype {query.dtype} is not one of float16, bfloat16, float32")
        if query.num_experts is not None and query.num_experts > MAX_GROUPS:
            reasons.append(f"{query.num_experts} experts: npu_grouped_matmul takes at most {MAX_GROUPS} groups")
        return reasons

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        self._gmm: GroupedMatmul | None = None

    def _grouped_matmul(self, x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
        if self._gmm is None:
            op = ops.find_op("npu_grouped_matmul")
            self._gmm = (
                grouped_matmul_torch
                if op is None
                else (lambda x, w, g: op([x], [w], group_list=g, split_item=2, group_type=0, group_list_type=0)[0])
            )
        return self._gmm(x, weight, group_list)

    def forward(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        routing: MoERouting,
    ) -> torch.Tensor:
        weights, ids = route(router_logits, routing)
        top_k, num_experts, inter = ids.shape[1], w13.shape[0], w2.shape[2]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # token-expert pairs grouped by expert
        token_of = order // top_k
        group_list = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0)
        x = hidden.index_select(0, token_of)
        gate_up = self._grouped_matmul(x, w13.transpose(1, 2), group_list)  # [M, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = self._grouped_matmul(act, w2.transpose(1, 2), group_list)  # [M, H]
        out = torch.zeros_like(hidden, dtype=torch.float32)
        out.index_add_(0, token_of, y.float() * weights.flatten()[order, None])
        return out.to(hidden.dtype)
