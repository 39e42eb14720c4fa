"""Batched LoRA: each request of a batch adds its own adapter's low-rank update.

A layer's adapters live in ``num_slots`` slots of two stacked tensors: ``a``
``[slots, n * r, in]`` and ``b`` ``[slots, out, r]``, for a layer fusing ``n``
projections (3 for q/k/v, 2 for gate/up, else 1) whose output rows are
``out_splits`` (one size per projection, in order) and a slot rank ``r``
(an adapter of smaller rank is zero-padded). A token whose request uses slot
``s`` adds, to projection ``j``'s rows of the layer's output,
``(x @ a[s, j*r:(j+1)*r].T) @ b[s, rows_j].T`` (the adapter's scaling already
folded into ``b``): one shrink over the stacked A matrices, then an expand of
each projection's rank columns into its own rows. That is the S-LoRA/Punica
shape of the computation ("SGMV": segmented gather matmul); B is kept per output
row, not block diagonal, so an expand reads no zeros.

A batch's tokens come in runs of one slot each (``LoRABatch.segments``: a
request's new tokens are contiguous, and neighbouring requests of one adapter
join into one run); tokens of requests on the base model are in no run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixserve.kernels.base import Backend
from radixserve.kernels.query import KernelQuery

NO_ADAPTER = -1  # the slot of a request served by the base model


@dataclass(frozen=True)
class LoRASegment:
    """Tokens ``[start, start + length)`` of the batch use slot ``slot``."""

    start: int
    length: int
    slot: int


@dataclass
class LoRABatch:
    """Which adapter slot each token of one forward uses, built once per step and
    read by every LoRA layer. ``segments`` (on the host) lists the runs of tokens
    of one slot in token order; ``seg_start``/``seg_len``/``seg_slot`` are the same
    on the device (int32), for kernels that launch one program per run;
    ``token_slot`` is each token's slot (``NO_ADAPTER`` for none), for kernels that
    work per token. ``slots`` is the distinct slots in use, ascending."""

    num_tokens: int
    segments: list[LoRASegment]
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    seg_slot: torch.Tensor
    token_slot: torch.Tensor
    slots: list[int] = field(default_factory=list)
    _rows_by_slot: dict[int, torch.Tensor] | None = field(default=None, repr=False)
    _padded: PaddedRows | None = field(default=None, repr=False)

    @classmethod
    def of(cls, token_counts: Sequence[int], request_slots: Sequence[int], device: torch.device) -> LoRABatch:
        """The batch whose request ``i`` has ``token_counts[i]`` new tokens, in order, and
        uses slot ``request_slots[i]`` (``NO_ADAPTER``: the base model)."""
        segments: list[LoRASegment] = []
        start = 0
        for count, slot in zip(token_counts, request_slots, strict=True):
            if count and slot != NO_ADAPTER:
                last = segments[-1] if segments else None
                if last is not None and last.slot == slot and last.start + last.length == start:
                    segments[-1] = LoRASegment(last.start, last.length + count, slot)
                else:
                    segments.append(LoRASegment(start, count, slot))
            start += count
        token_slot = torch.full((start,), NO_ADAPTER, dtype=torch.int32)
        for seg in segments:
            token_slot[seg.start : seg.start + seg.length] = seg.slot

        def on_device(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        return cls(
            num_tokens=start,
            segments=segments,
            seg_start=on_device([s.start for s in segments]),
            seg_len=on_device([s.length for s in segments]),
            seg_slot=on_device([s.slot for s in segments]),
            token_slot=token_slot.to(device, non_blocking=True),
            slots=sorted({s.slot for s in segments}),
        )

    @property
    def max_segment_len(self) -> int:
        return max((s.length for s in self.segments), default=0)

    def rows_by_slot(self) -> dict[int, torch.Tensor]:
        """Per slot in use, the indices of its tokens (int64, on the batch's device);
        made on the first call and kept, so every layer of the step shares them."""
        if self._rows_by_slot is None:
            self._rows_by_slot = {slot: self._on_device(index) for slot, index in self._host_rows().items()}
        return self._rows_by_slot

    def padded_rows(self) -> PaddedRows:
        """The adapted tokens laid out slot by slot, ``width`` rows a slot, for one batched
        matmul over slots ``[first_slot, first_slot + num_slots)`` (made once, then kept)."""
        if self._padded is None:
            first, last = self.slots[0], self.slots[-1]
            rows = self._host_rows()
            width = max(len(r) for r in rows.values())
            order = [t for slot in self.slots for t in rows[slot]]
            pos = [(slot - first) * width + i for slot in self.slots for i in range(len(rows[slot]))]
            self._padded = PaddedRows(self._on_device(order), self._on_device(pos), width, first, last - first + 1)
        return self._padded

    def _host_rows(self) -> dict[int, list[int]]:
        rows: dict[int, list[int]] = {}
        for seg in self.segments:
            rows.setdefault(seg.slot, []).extend(range(seg.start, seg.start + seg.length))
        return rows

    def _on_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.token_slot.device, non_blocking=True)


@dataclass(frozen=True)
class PaddedRows:
    """Token ``order[i]`` goes to row ``pos[i]`` of a ``[num_slots * width, in]`` layout
    whose block ``j`` holds slot ``first_slot + j``'s tokens (zero rows after them)."""

    order: torch.Tensor
    pos: torch.Tensor
    width: int
    first_slot: int
    num_slots: int

    @property
    def rows(self) -> int:
        return self.num_slots * self.width


class LoRABackend(Backend):
    """Adds each token's adapter update to a layer's output, in place: for every
    token ``t`` in a segment of slot ``s`` and each projection ``j`` (output rows
    ``[o_j, o_j + out_splits[j])``, rank columns ``[j*r, (j+1)*r)``),
    ``out[t, o_j:...] += (x[t] @ a[s, j*r:(j+1)*r].T) @ b[s, o_j:...].T``; rows in no
    segment are left as they are.

    Shapes: ``x`` ``[T, in]``, ``out`` ``[T, out]`` (the base projection's result,
    the model dtype), ``a`` ``[slots, len(out_splits) * r, in]``, ``b``
    ``[slots, out, r]``, all of the model's dtype. The shrink's intermediate may be
    kept in float32 or rounded to the model dtype (what PEFT does); the conformance
    kit allows either.
    """

    def __init__(self, query: KernelQuery):
        self.query = query

    def apply(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        batch: LoRABatch,
        out_splits: tuple[int, ...],
    ) -> None:
        raise NotImplementedError


def lora_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch, out_splits: tuple[int, ...]
) -> torch.Tensor:
    """The update ``apply`` adds, ``[T, out]`` in float64: the ground truth the conformance
    kit holds backends to."""
    delta = torch.zeros((x.shape[0], b.shape[1]), dtype=torch.float64, device=x.device)
    rank = b.shape[2]
    for seg in batch.segments:
        rows = slice(seg.start, seg.start + seg.length)
        shrink = x[rows].double() @ a[seg.slot].double().T
        start = 0
        for j, size in enumerate(out_splits):
            cols = slice(start, start + size)
            delta[rows, cols] = shrink[:, j * rank : (j + 1) * rank] @ b[seg.slot, cols].double().T
            start += size
    return delta
