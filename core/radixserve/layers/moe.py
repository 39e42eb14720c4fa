"""Mixture-of-experts layers: a replicated router and stacked expert weights that
``ctx.moe`` runs (see :class:`radixserve.kernels.moe.MoEBackend`), and
:class:`SparseMoE`, the two together as HF's sparse blocks name them.

Experts are split by intermediate size across TP ranks: every rank holds every
expert's slice of gate/up rows and down columns, and the partial outputs are
all-reduced.

A checkpoint that ships quantized (GPTQ, AWQ, compressed-tensors, FP8 blocks) stores
each expert's projection as several tensors (``qweight``, ``scales``, ...): they are
gathered per projection and dequantized at load by the quantization method
(``QuantizationMethod.dense_weight``), so the experts run in the model's dtype on the
MoE backend: served, not smaller.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from radixserve.kernels import MoEBackend, MoERouting
from radixserve.layers.context import ModelContext
from radixserve.layers.layer import Layer
from radixserve.layers.parallel import all_reduce, divide
from radixserve.layers.weights import CheckpointTensor, copy_into, set_shard_ids, set_weight_loader


class MoERouter(Layer):
    """Router logits ``[T, E]`` from hidden ``[T, H]``; weight ``[E, H]``, never quantized."""

    def __init__(self, hidden_size: int, num_experts: int, ctx: ModelContext):
        super().__init__()
        self.gemm = ctx.gemm
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=ctx.dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gemm.linear(hidden, self.weight)


class FusedMoE(Layer):
    """Experts as two stacked parameters: ``w13_weight`` ``[E, 2*I, H]`` (each
    expert's gate rows, then its up rows) and ``w2_weight`` ``[E, H, I]``, with I
    this rank's intermediate size.

    Shard ids for ``weight_loader``: ``(expert, "gate" | "up")`` for one expert's
    ``[I, H]`` projection into ``w13_weight``, ``(expert, "down")`` for its
    ``[H, I]`` projection into ``w2_weight``, or ``None`` for a checkpoint that
    already stacks all experts in this layout; ``(expert, part, tensor)`` for one of
    the tensors a quantized checkpoint stores the projection as (``tensor`` one of
    the method's ``checkpoint_tensor_names``; ``"weight"``: the float weight).

    Routing (``MoERouting``): top-k of the softmax over the router logits,
    renormalized or not, optionally group-limited (``num_groups``,
    ``topk_groups``) and scaled (``scaling_factor``).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        ctx: ModelContext,
        renormalize: bool,
        num_groups: int = 1,
        topk_groups: int = 1,
        scaling_factor: float = 1.0,
    ):
        super().__init__()
        if ctx.moe is None:
            raise ValueError("the model has MoE layers but the ModelContext has no MoE backend")
        self.ctx = ctx
        self.moe: MoEBackend = ctx.moe
        self.num_experts = num_experts
        self.intermediate_full = intermediate_size
        self.intermediate = divide(intermediate_size, ctx.tp_size)
        self.routing = MoERouting(
            top_k=top_k,
            renormalize=renormalize,
            num_groups=num_groups,
            topk_groups=topk_groups,
            scaling_factor=scaling_factor,
        )
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * self.intermediate, hidden_size, dtype=ctx.dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.intermediate, dtype=ctx.dtype), requires_grad=False
        )
        # A quantized checkpoint's tensors of one projection, gathered until all have come.
        self.checkpoint_tensors = ctx.quant.checkpoint_tensor_names() or ("weight",)
        self._gathered: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        set_weight_loader(self.w13_weight, self.weight_loader)
        set_shard_ids(self.w13_weight, self._shard_ids(num_experts, ("gate", "up")))
        set_weight_loader(self.w2_weight, self.weight_loader)
        set_shard_ids(self.w2_weight, self._shard_ids(num_experts, ("down",)))

    def _shard_ids(self, num_experts: int, parts: tuple[str, ...]) -> tuple[Any, ...]:
        return tuple((e, part, t) for e in range(num_experts) for part in parts for t in self.checkpoint_tensors)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor, shard_id: Any = None) -> None:
        if shard_id is not None and len(shard_id) == 3:
            expert, part, tensor_name = shard_id
            if tensor_name not in self.checkpoint_tensors:
                raise ValueError(
                    f"expert {expert} {part}: a {tensor_name!r} tensor where the checkpoint's "
                    f"projections are stored as {', '.join(self.checkpoint_tensors)}"
                )
            if self.checkpoint_tensors == ("weight",):
                self.weight_loader(param, loaded, (expert, part))
                return
            gathered = self._gathered.setdefault((expert, part), {})
            gathered[tensor_name] = loaded.load() if isinstance(loaded, CheckpointTensor) else loaded
            if len(gathered) == len(self.checkpoint_tensors):
                del self._gathered[(expert, part)]
                self.weight_loader(param, self.ctx.quant.dense_weight(gathered).to(param.dtype), (expert, part))
            return
        full, local, start = self.intermediate_full, self.intermediate, self.ctx.tp_rank * self.intermediate
        if shard_id is None:
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"stacked experts tensor has {loaded.shape[0]} experts, expected {self.num_experts}")
            for e in range(self.num_experts):
                if param is self.w13_weight:
                    self.weight_loader(param, loaded[e, :full], (e, "gate"))
                    self.weight_loader(param, loaded[e, full:], (e, "up"))
                else:
                    self.weight_loader(param, loaded[e], (e, "down"))
            return
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (num_experts={self.num_experts})")
        if part not in ("gate", "up", "down") or (param is self.w2_weight) != (part == "down"):
            raise ValueError(f"shard {shard_id!r} does not belong to this parameter")
        if part == "down":
            copy_into(param.data[expert], loaded.narrow(1, start, local), f"expert {expert} down")
        else:
            offset = 0 if part == "gate" else local
            copy_into(
                param.data[expert, offset : offset + local], loaded.narrow(0, start, local), f"expert {expert} {part}"
            )

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = self.moe.forward(hidden, router_logits, self.w13_weight, self.w2_weight, self.routing)
        return all_reduce(out, self.ctx)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.routing.top_k}, intermediate_per_rank={self.intermediate}"


class SparseMoE(Layer):
    """A router and its experts, ``experts(x, gate(x))``, with HF's parameter
    names: ``gate.weight``, ``experts.w13_weight``, ``experts.w2_weight``."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        ctx: ModelContext,
        renormalize: bool,
    ):
        super().__init__()
        self.gate = MoERouter(hidden_size, num_experts, ctx)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, ctx, renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.experts(x, self.gate(x))
        return out


# transformers 5's in-memory (and some checkpoints') stacked experts: gate_up_proj
# [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I], FusedMoE's own layout.
_STACKED_EXPERTS = {"experts.gate_up_proj": "experts.w13_weight", "experts.down_proj": "experts.w2_weight"}


def expert_weight_name(name: str, per_expert: re.Pattern[str], parts: Mapping[str, str]) -> tuple[str, Any] | None:
    """The :class:`FusedMoE` parameter and shard id of the checkpoint tensor
    ``name``, or None when it is not an expert weight. ``per_expert`` matches one
    expert's projection tensor at the end of a name; its three groups are the expert
    index, the projection's checkpoint name, which ``parts`` maps to ``"gate"``,
    ``"up"`` or ``"down"`` (Mixtral's ``w1``, ``w3``, ``w2``), and the tensor's name
    (``weight``; ``qweight``, ``scales``, ... in a quantized checkpoint). Stacked
    tensors (``experts.gate_up_proj``, ``experts.down_proj``) load whole."""
    match = per_expert.search(name)
    if match:
        part = parts[match.group(2)]
        param = "experts.w2_weight" if part == "down" else "experts.w13_weight"
        return f"{name[: match.start()]}.{param}", (int(match.group(1)), part, match.group(3))
    for suffix, param in _STACKED_EXPERTS.items():
        if name.endswith("." + suffix):
            return name[: -len(suffix)] + param, None
    return None
