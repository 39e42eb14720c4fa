"""KV slots as a tensor, for the tests that drive a ``PagedAllocator`` by hand
(the scheduler takes them as host ints, from ``PagedAllocator.alloc_slots``)."""

from __future__ import annotations

import torch

from radixserve.cache.memory_pool import PagedAllocator


def alloc_extend(
    alloc: PagedAllocator, prefix_lens: list[int], last_locs: list[int], extend_lens: list[int]
) -> torch.Tensor | None:
    """``alloc_slots`` as a device tensor."""
    out = alloc.alloc_slots(prefix_lens, last_locs, extend_lens)
    return None if out is None else alloc.transfer.to_device(out)


def alloc_tokens(alloc: PagedAllocator, num_tokens: int) -> torch.Tensor | None:
    """Slots for ``num_tokens`` tokens starting on a fresh page."""
    return alloc_extend(alloc, [0], [-1], [num_tokens])
