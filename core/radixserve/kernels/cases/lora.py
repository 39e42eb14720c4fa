"""LoRA cases: ``LoRACase`` (one batched adapter update: each request's tokens,
the slot it uses, and the fused layer's projections) and the inputs it makes
(``make_lora_inputs``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixserve.kernels.lora import NO_ADAPTER, LoRABatch
from radixserve.kernels.query import KernelQuery


@dataclass(frozen=True)
class LoRACase:
    name: str
    token_counts: tuple[int, ...]  # new tokens of each request, in batch order
    request_slots: tuple[int, ...]  # each request's slot; NO_ADAPTER: the base model
    in_features: int
    out_features: int
    rank: int  # the slots' width r (KernelQuery.max_lora_rank)
    num_slots: int
    # Projections sharing one shrink (3: q/k/v, 2: gate/up), so a's rows K = rank * fused.
    fused: int = 1
    # Each projection's output rows, in order (sum: out_features). Empty: derived from
    # ``fused``: (out,); gate/up equal halves; q/k/v as (q, kv, kv) with kv = out // 4,
    # so q != kv and a kernel that takes the projections as equal is caught.
    out_splits: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.token_counts) != len(self.request_slots):
            raise ValueError(f"{self.name}: {len(self.token_counts)} token counts, {len(self.request_slots)} slots")
        bad = [s for s in self.request_slots if s != NO_ADAPTER and not 0 <= s < self.num_slots]
        if bad:
            raise ValueError(f"{self.name}: slots {bad} outside 0..{self.num_slots - 1}")
        splits = self.out_splits or _default_splits(self.name, self.out_features, self.fused)
        if len(splits) != self.fused or sum(splits) != self.out_features or min(splits) < 0:
            raise ValueError(
                f"{self.name}: out_splits {splits} must be {self.fused} sizes summing to {self.out_features}"
            )
        object.__setattr__(self, "out_splits", tuple(splits))

    @property
    def rank_columns(self) -> int:
        return self.rank * self.fused

    @property
    def num_tokens(self) -> int:
        return sum(self.token_counts)

    def query(self, device: str, dtype: torch.dtype) -> KernelQuery:
        return KernelQuery(device=device, dtype=dtype, max_lora_rank=self.rank)


def _default_splits(name: str, out: int, fused: int) -> tuple[int, ...]:
    if fused == 1:
        return (out,)
    if fused == 2:
        if out % 2:
            raise ValueError(f"{name}: gate/up (fused=2) needs an even out_features, not {out}")
        return (out // 2, out // 2)
    if fused == 3:
        kv = out // 4
        return (out - 2 * kv, kv, kv)
    raise ValueError(f"{name}: fused={fused} needs explicit out_splits")


def make_lora_inputs(
    case: LoRACase, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LoRABatch, tuple[int, ...]]:
    """``(x, out, a, b, batch, out_splits)`` on ``device``, ``LoRABackend.apply``'s
    arguments in order: ``x`` ``[T, in]``, ``out`` ``[T, out]`` (the base projection's
    result), ``a`` ``[slots, fused * r, in]``, ``b`` ``[slots, out, r]``, every slot
    filled (a kernel that reads the wrong one is wrong by as much as the update).
    Scaled so the update is about as large as ``out``."""
    gen = torch.Generator().manual_seed(seed)
    t, r, n_in, n_out = case.num_tokens, case.rank, case.in_features, case.out_features
    x = torch.randn((t, n_in), generator=gen)
    out = torch.randn((t, n_out), generator=gen)
    a = torch.randn((case.num_slots, case.rank_columns, n_in), generator=gen) / math.sqrt(n_in)
    b = torch.randn((case.num_slots, n_out, r), generator=gen) / math.sqrt(r)
    batch = LoRABatch.of(case.token_counts, case.request_slots, torch.device(device))
    x, out, a, b = (v.to(device=device, dtype=dtype) for v in (x, out, a, b))
    return x, out, a, b, batch, case.out_splits
