"""``cpu_sgmv``: batched LoRA in one C++ call per layer (csrc/cpu_lora.cpp).

A decode step over many adapters gives each adapter's slot a token or two, so the
update is bound by reading each slot's A and B once; ``torch_grouped`` reads them
once too, but spends a dozen torch calls a layer gathering the tokens into a
padded layout, multiplying and adding them back. Here one call walks each slot's
A rows for all its tokens, then its B rows (2x ``torch_grouped``'s speed on a
decode step of 16 adapters, and faster still on interleaved runs of up to 128
tokens a slot: docs/benchmarks.md, P20). A prefill whose every slot has one run,
some longer than ``PREFILL_RUN`` tokens, is a few matrix products the C++ loops
do not tile for: it goes to ``torch_grouped``, which runs them on views.
"""

from __future__ import annotations

import torch

from radixserve.kernels import KernelQuery, LoRABatch
from radixserve_torch import cpu_kernels
from radixserve_torch.lora import TorchGroupedLoRA


class CpuSgmvLoRA(TorchGroupedLoRA):
    name = "cpu_sgmv"
    priority = 2  # above torch_grouped (1); auto decides by timing where it runs

    PREFILL_RUN = 16

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        cpu_kernels.load()
        self._sgmv = torch.ops.radixserve_cpu_lora.sgmv

    @classmethod
    def build(cls) -> None:
        cpu_kernels.load()

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return cpu_kernels.query_reasons(query) + super().unsupported_reasons(query) + cpu_kernels.unavailable_reasons()

    def apply(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        batch: LoRABatch,
        out_splits: tuple[int, ...],
    ) -> None:
        if len(batch.segments) == len(batch.slots) and batch.max_segment_len > self.PREFILL_RUN:
            super().apply(x, out, a, b, batch, out_splits)
            return
        self._sgmv(x, out, a, b, batch.token_slot, list(out_splits))
