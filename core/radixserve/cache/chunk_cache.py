"""The prefix cache used with ``--disable-radix-cache``: it caches nothing.

Every request owns all of its slots from allocation to finish, so matches are
empty, ``num_cached`` stays 0 and there is nothing to lock, evict or reset.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from radixserve.cache.base import MatchResult, PrefixCache
from radixserve.cache.memory_pool import PagedAllocator


class ChunkCache(PrefixCache):
    caches_prefixes = False

    def __init__(self, allocator: PagedAllocator, page_size: int):
        if allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} != allocator page size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size

    def _empty(self) -> MatchResult:
        return MatchResult(slots=torch.empty(0, dtype=torch.int64, device=self.allocator.device), last_node=None)

    def match_prefix(self, token_ids: list[int], namespace: Hashable = None) -> MatchResult:
        return self._empty()

    def cached_len(self, token_ids: list[int], namespace: Hashable = None) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def cache_finished_req(
        self, token_ids: list[int], slots: torch.Tensor, last_node: Any, num_cached: int, namespace: Hashable = None
    ) -> None:
        self.allocator.free(slots)

    def cache_unfinished_req(
        self, token_ids: list[int], slots: torch.Tensor, last_node: Any, num_cached: int, namespace: Hashable = None
    ) -> MatchResult:
        """The request keeps all its slots; its row stays as it is and none of it is cached."""
        return self._empty()

    def evict(self, num_tokens: int) -> int:
        return 0

    def drop_namespaces(self, which: Callable[[Hashable], bool]) -> int:
        return 0  # nothing is cached

    def reset(self) -> bool:
        return True

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def lock_mismatch(self, pins: list[Any]) -> str | None:
        stray = [p for p in pins if p is not None]
        return f"{len(stray)} pins on a cache that locks nothing" if stray else None

    def check_invariants(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"ChunkCache(page_size={self.page_size})"
