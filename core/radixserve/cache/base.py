"""The interface the scheduler uses for prefix caching, shared by RadixCache and ChunkCache.

Ownership of a request's KV slots: the first ``num_cached`` tokens belong to the
cache (pinned through ``last_node``), the rest are the request's own. The
request-level helpers move slots between the two and free what nobody owns, so
that at all times

    allocator.available_size() + requests' own slots (whole pages)
        + cache.total_size() == allocator.size

Prefixes are shared within a *namespace* only: equal tokens whose KV was
computed differently (LongRoPE's two sets of frequencies, layers/rotary.py;
later, a LoRA adapter) must never match each other. Every lookup and insert
names the request's namespace (``Req.cache_namespace``: any hashable; None, the
default, is the plain one), and each namespace is a prefix tree of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class MatchResult:
    """A cached prefix: the KV ``slots`` of its tokens (page aligned) and ``last_node``,
    an opaque handle to pass back to the cache for locking and unlocking."""

    slots: torch.Tensor
    last_node: Any

    @property
    def num_tokens(self) -> int:
        return self.slots.numel()


class PrefixCache(ABC):
    #: Whether anything is ever cached (False for ChunkCache): chunks then need not end on pages,
    #: and requests never wait to share a prefix another one is computing.
    caches_prefixes: bool = True

    @abstractmethod
    def match_prefix(self, token_ids: list[int], namespace: Hashable = None) -> MatchResult:
        """The longest cached page-aligned prefix of ``token_ids`` in ``namespace`` (not locked)."""

    @abstractmethod
    def cached_len(self, token_ids: list[int], namespace: Hashable = None) -> int:
        """How many leading tokens of ``token_ids`` are cached in ``namespace`` now, found
        without changing anything (no split, no access time): what a load report counts."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Pin ``node`` and its ancestors so they cannot be evicted."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one ``inc_lock_ref(node)``."""

    @abstractmethod
    def cache_finished_req(
        self, token_ids: list[int], slots: torch.Tensor, last_node: Any, num_cached: int, namespace: Hashable = None
    ) -> None:
        """A request is done. ``slots[i]`` is the KV slot of ``token_ids[i]``; the first
        ``num_cached`` came from the cache (of ``namespace``, the request's) and are
        locked through ``last_node``. Keeps what is worth caching, frees the rest of
        the request's slots, and unlocks."""

    @abstractmethod
    def cache_unfinished_req(
        self, token_ids: list[int], slots: torch.Tensor, last_node: Any, num_cached: int, namespace: Hashable = None
    ) -> MatchResult:
        """Cache a running request's KV so far (chunked prefill). Returns the request's new
        cached prefix, already locked (the old ``last_node`` is unlocked): its slots
        replace the first ``num_tokens`` entries of the request's row, and its
        ``num_tokens`` is the request's new ``num_cached``. Slots past it stay the request's."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots if possible; returns how many were freed."""

    @abstractmethod
    def drop_namespaces(self, which: Callable[[Hashable], bool]) -> int:
        """Free what the namespaces ``which`` accepts hold that nothing has locked (an
        unloaded LoRA adapter's KV); returns the tokens freed."""

    @abstractmethod
    def reset(self) -> bool:
        """Drop everything cached; False (and nothing done) while anything is locked."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held by the cache that nothing has locked."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held by the cache and locked by running requests."""

    def total_size(self) -> int:
        """Tokens held by the cache."""
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def lock_mismatch(self, pins: list[Any]) -> str | None:
        """None when the locks held are exactly one per entry of ``pins`` (the nodes
        that requests have locked, repeats included); else what differs."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Recompute the bookkeeping from scratch and assert it matches (for tests)."""
