"""The KV ledger: the one owner of who holds which KV slot.

Every slot of the pool belongs to exactly one of: the allocator's free list, a
request (its own pages), or the prefix cache, where a slot is *locked* while a
request reads it and *evictable* otherwise. The ledger holds the allocator, the
token table's rows, the prefix cache and the requests' locks, and is the only
thing that moves slots between them, through a few verbs:

- ``pin`` / ``unpin`` a matched prefix while admission weighs a request (a pinned
  prefix stops counting as evictable room);
- ``admit`` a request against its pinned match: a row of the token table, the
  cached prefix's slots and the request's token ids written into it;
- ``allocate`` slots for a step's new tokens (evicting the cache as needed);
- ``cache_prefix``: hand a request's computed pages to the cache (chunked prefill);
- ``trim`` a request's tokens past what a verify step kept (speculative decoding);
- ``release`` a finished or retracted request: its computed pages go to the
  cache (or back to the allocator), its lock and row are given back;
- ``discard`` an aborted or failed request: its own pages are freed uncached.

What a request holds is its ``KVSpan`` (``req.kv``, see ``runtime/execution/request.py``), which
only the ledger writes. At every step boundary ``counts().ok`` holds: free + private + locked +
evictable == total, the cache's locks are exactly the ones its holders and
pins account for (so a lock leaked by an abort shows, even while its pages are
"cached"), and every row of the token table is free, held or being handed back.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from radixserve.cache.base import MatchResult, PrefixCache
from radixserve.cache.memory_pool import PagedAllocator, ReqToTokenPool
from radixserve.runtime.execution.request import HoldsKV, KVSpan, Req

Recorded = TypeVar("Recorded")


@dataclass(frozen=True)
class PoolCounts:
    """Where the pool's slots are (in tokens, whole pages)."""

    total: int
    free: int
    private: int
    cached_locked: int
    cached_evictable: int
    lock_error: str | None  # None when the cache's locks are exactly the holders' and pins'
    rows_unaccounted: int  # token table rows neither free, nor held, nor waiting to be reused

    @property
    def cached(self) -> int:
        return self.cached_locked + self.cached_evictable

    @property
    def ok(self) -> bool:
        balanced = self.free + self.private + self.cached == self.total
        return balanced and self.lock_error is None and self.rows_unaccounted == 0


class KVLedger:
    def __init__(self, allocator: PagedAllocator, token_table: ReqToTokenPool, cache: PrefixCache):
        self.allocator = allocator
        self.token_table = token_table
        self.cache = cache
        self.page_size = allocator.page_size
        self._holders: dict[int, Req] = {}  # token table row -> the request holding it
        self._pins: list[Any] = []  # nodes pinned for requests not admitted yet
        # Rows of ended requests that a launched step may still read and write
        # (overlap: a request that finished in one step runs in the next); the
        # scheduler hands them back once the steps launched before have finished.
        self._released_rows: list[int] = []

    # ---- views -----------------------------------------------------------------
    @property
    def total(self) -> int:
        return self.allocator.size

    @property
    def caches_prefixes(self) -> bool:
        return self.cache.caches_prefixes

    def match(self, token_ids: list[int], namespace: Hashable = None) -> MatchResult:
        return self.cache.match_prefix(token_ids, namespace)

    def cached_len(self, token_ids: list[int], namespace: Hashable = None) -> int:
        """The cached prefix of ``token_ids``, counted without touching the cache."""
        return self.cache.cached_len(token_ids, namespace)

    def room(self) -> int:
        """Slots a step could take: free ones plus the cache's evictable ones."""
        return self.allocator.available_size() + self.cache.evictable_size()

    def free_rows(self) -> int:
        return self.token_table.available_size()

    def pages_needed(self, kv_lens: list[int], extend_lens: list[int]) -> int:
        return self.allocator.pages_needed(kv_lens, extend_lens)

    def holders(self) -> list[Req]:
        """Requests holding a row (and so, possibly, KV), in admission order."""
        return list(self._holders.values())

    def private_tokens(self) -> int:
        """Slots owned by requests themselves (whole pages), not by the cache."""
        ps = self.page_size
        holders = cast("Iterable[HoldsKV]", self._holders.values())
        return sum((-(-r.kv.kv_len // ps) - r.kv.num_cached // ps) * ps for r in holders)

    def counts(self, exact: bool = True) -> PoolCounts:
        """``exact`` waits for the frees still on their way to the host and checks
        every lock of the cache; the step logs pass False and never wait."""
        pins = [r.kv.last_node for r in cast("Iterable[HoldsKV]", self._holders.values())] + self._pins
        return PoolCounts(
            total=self.total,
            free=self.allocator.available_size(wait=exact),
            private=self.private_tokens(),
            cached_locked=self.cache.protected_size(),
            cached_evictable=self.cache.evictable_size(),
            lock_error=self.cache.lock_mismatch(pins) if exact else None,
            rows_unaccounted=self.token_table.size
            - self.token_table.available_size()
            - len(self._holders)
            - len(self._released_rows),
        )

    # ---- verbs -----------------------------------------------------------------
    def pin(self, match: MatchResult) -> None:
        """Lock a matched prefix while its request is weighed for admission."""
        if match.last_node is not None:
            self.cache.inc_lock_ref(match.last_node)
        self._pins.append(match.last_node)

    def unpin(self, match: MatchResult) -> None:
        self._take_pin(match)
        if match.last_node is not None:
            self.cache.dec_lock_ref(match.last_node)

    def drop_pins(self) -> None:
        """Unpin every match not admitted (after a failed step launch)."""
        for node in self._pins:
            if node is not None:
                self.cache.dec_lock_ref(node)
        self._pins.clear()

    def admit(self, req: Req, match: MatchResult) -> None:
        """Give ``req`` a row holding its tokens and its pinned cached prefix (the pin
        becomes the request's lock)."""
        if req.kv is not None:
            raise ValueError(f"request {req.rid} already holds KV")
        row = self.token_table.alloc()
        if row is None:
            raise RuntimeError("no free token table row; admission must check free_rows()")
        self._take_pin(match)
        prefix = match.num_tokens
        if prefix:
            self.token_table.write(row, 0, match.slots)
        self.token_table.write_tokens(row, 0, req.fill_ids)
        req.kv = KVSpan(row=row, kv_len=prefix, num_cached=prefix, last_node=match.last_node)
        self._holders[row] = req

    def allocate(self, reqs: list[Req], extend_lens: list[int], record: Callable[[list[int]], Recorded]) -> Recorded:
        """KV slots for ``extend_lens[i]`` new tokens of each request, in request order,
        evicting the cache as needed. ``record(slots)`` writes them into the requests'
        token-table rows (the step's batch, in one scatter with its other inputs) and
        its result is returned; each request's ``kv_len`` then counts them. If
        ``record`` raises, the slots go back and the requests are as they were, so
        that ``discard`` never reads a row entry the step did not write."""
        spans = cast("list[KVSpan]", [r.kv for r in reqs])  # admitted requests: every kv is set
        kv_lens = [s.kv_len for s in spans]
        need = self.allocator.pages_needed(kv_lens, extend_lens) * self.page_size
        # Before evicting the cache, wait for the frees still on their way to the host.
        if need > self.allocator.available_size() and need > self.allocator.available_size(wait=True):
            self.cache.evict(need - self.allocator.available_size())
        slots = self.allocator.alloc_slots(kv_lens, [s.last_slot for s in spans], extend_lens)
        if slots is None:
            raise RuntimeError("KV pool exhausted after admission; the admission budget is wrong")
        try:
            recorded = record(slots)
        except BaseException:
            self.allocator.undo_alloc(kv_lens, extend_lens, slots)
            raise
        for span, n, end in zip(spans, extend_lens, itertools.accumulate(extend_lens), strict=True):
            span.kv_len += n
            span.last_slot = slots[end - 1]
        return recorded

    def cache_prefix(self, req: Req, computed: int) -> None:
        """Hand the whole pages of ``req``'s first ``computed`` tokens to the cache, so
        its next chunk and other requests can share them."""
        if not self.caches_prefixes:
            return
        span = cast(KVSpan, req.kv)  # an admitted request's
        slots = self.token_table.req_to_token[span.row, :computed].clone()
        match = self.cache.cache_unfinished_req(
            req.fill_ids[:computed], slots, span.last_node, span.num_cached, req.cache_namespace
        )
        self.token_table.write(span.row, 0, match.slots)
        span.num_cached, span.last_node = match.num_tokens, match.last_node

    def trim(self, req: Req, kv_len: int, last_slot: int) -> None:
        """Keep ``req``'s first ``kv_len`` computed tokens (``last_slot``: the slot of token
        ``kv_len - 1``) and free the pages past the one holding that token: a verify step
        computed proposals the model refused. The rest of that page stays the request's,
        and its next step writes over it."""
        span = cast(KVSpan, req.kv)  # an admitted request's
        if not span.num_cached <= kv_len <= span.kv_len:
            raise ValueError(f"trim of {req.rid} to {kv_len}: outside [{span.num_cached}, {span.kv_len}]")
        kept_pages_end = -(-kv_len // self.page_size) * self.page_size
        if kept_pages_end < span.kv_len:
            self.allocator.free(self.token_table.req_to_token[span.row, kept_pages_end : span.kv_len].clone())
        span.kv_len, span.last_slot = kv_len, last_slot

    def release(self, req: Req) -> None:
        """A finished or retracted request gives back its KV: the computed pages go to
        the cache (or back to the allocator), its lock and its row are returned."""
        span = req.kv
        if span is None:
            return
        slots = self.token_table.req_to_token[span.row, : span.kv_len].clone()
        namespace = req.cache_namespace
        self.cache.cache_finished_req(req.fill_ids[: span.kv_len], slots, span.last_node, span.num_cached, namespace)
        self._end(req, span)

    def discard(self, req: Req) -> None:
        """An aborted or failed request frees its own pages uncached (their KV may be
        incomplete) and unlocks its cached prefix."""
        span = req.kv
        if span is None:
            return
        self.allocator.free(self.token_table.req_to_token[span.row, span.num_cached : span.kv_len].clone())
        if span.last_node is not None:
            self.cache.dec_lock_ref(span.last_node)
        self._end(req, span)

    def take_released_rows(self) -> list[int]:
        """Rows given back since the last call; ``reuse_rows`` them once no launched
        step can touch them."""
        rows, self._released_rows = self._released_rows, []
        return rows

    def reuse_rows(self, rows: list[int]) -> None:
        for row in rows:
            self.token_table.free(row)

    def drop_cached(self, which: Callable[[Hashable], bool]) -> int:
        """Free the unlocked cached KV of the namespaces ``which`` accepts (an unloaded LoRA adapter's)."""
        return self.cache.drop_namespaces(which)

    def flush(self) -> bool:
        """Empty the prefix cache; False (nothing done) while any request holds KV."""
        return not self._holders and not self._pins and self.cache.reset()

    # ---- internals -------------------------------------------------------------
    def _take_pin(self, match: MatchResult) -> None:
        try:
            self._pins.remove(match.last_node)
        except ValueError:
            raise ValueError("this match was not pinned") from None

    def _end(self, req: Req, span: KVSpan) -> None:
        """``span``: ``req.kv``, which it gives up."""
        del self._holders[span.row]
        self._released_rows.append(span.row)
        req.kv = None
