"""Batched LoRA in plain PyTorch: ``torch_native``, the reference (one shrink and
an expand per projection for each run of tokens), and ``torch_grouped``, which
gathers the tokens of all slots into one layout for batched matmuls, however a
batch interleaves the adapters (a decode batch of many adapters has a run per
request)."""

from __future__ import annotations

import torch

from radixserve.kernels import LoRABackend, LoRABatch


def _expand(shrink: torch.Tensor, b: torch.Tensor, out_splits: tuple[int, ...]) -> list[torch.Tensor]:
    """Each projection's update, ``[..., size_j]``: its rank columns of ``shrink`` (``[..., n*r]``)
    through its rows of ``b`` (``[..., out, r]``, a batch of slots or one slot)."""
    rank = b.shape[-1]
    parts, start = [], 0
    for j, size in enumerate(out_splits):
        part = shrink[..., j * rank : (j + 1) * rank] @ b[..., start : start + size, :].transpose(-1, -2)
        parts.append(part)
        start += size
    return parts


class TorchNativeLoRA(LoRABackend):
    """Per run of tokens: ``x @ a[s].T``, rounded to the model dtype as PEFT's
    ``lora_B(lora_A(x))`` is, then each projection's expand added to its rows."""

    name = "torch_native"
    priority = 0

    def apply(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        batch: LoRABatch,
        out_splits: tuple[int, ...],
    ) -> None:
        for seg in batch.segments:
            rows = slice(seg.start, seg.start + seg.length)
            out[rows] += torch.cat(_expand(x[rows] @ a[seg.slot].T, b[seg.slot], out_splits), dim=-1)


class TorchGroupedLoRA(TorchNativeLoRA):
    """The tokens of each slot gathered into one layout, one batched shrink and a
    batched expand per projection over the slots in use, the result added back by
    index: a decode batch whose requests interleave many adapters costs a few calls,
    not a few per adapter (2-5x faster than a loop over slots at 4-16 adapters of a
    32-request decode step on an EPYC, bf16: docs/benchmarks.md, P20). A batch of one run per slot (a
    prefill) runs each run on views; one whose slots hold very unequal token counts
    (the padded layout more than twice the tokens) loops over the slots."""

    name = "torch_grouped"
    priority = 1

    def apply(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        batch: LoRABatch,
        out_splits: tuple[int, ...],
    ) -> None:
        if len(batch.segments) == len(batch.slots):  # one run per slot: views, no gather
            super().apply(x, out, a, b, batch, out_splits)
            return
        layout = batch.padded_rows()
        if layout.rows > 2 * layout.order.numel():
            for slot, index in batch.rows_by_slot().items():
                delta = torch.cat(_expand(x.index_select(0, index) @ a[slot].T, b[slot], out_splits), dim=-1)
                out.index_add_(0, index, delta)
            return
        slots = slice(layout.first_slot, layout.first_slot + layout.num_slots)
        padded = x.new_zeros((layout.rows, x.shape[1]))
        padded[layout.pos] = x[layout.order]
        shrink = torch.bmm(padded.view(layout.num_slots, layout.width, -1), a[slots].transpose(1, 2))
        expand = torch.cat(_expand(shrink, b[slots], out_splits), dim=-1).view(layout.rows, -1)
        out.index_add_(0, layout.order, expand[layout.pos])
