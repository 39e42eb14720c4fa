"""RadixCache and ChunkCache against a real PagedAllocator.

Every scenario ends by checking the pool invariant exactly, page by page: each
page is free, owned by one running request, or held by the cache (never two).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from helpers_cache import alloc_extend, alloc_tokens

from radixserve.cache.base import PrefixCache
from radixserve.cache.chunk_cache import ChunkCache
from radixserve.cache.memory_pool import PagedAllocator
from radixserve.cache.radix_cache import RadixCache

CPU = torch.device("cpu")


@dataclass
class Req:
    """The scheduler's view of a request: tokens with KV, their slots, the cached prefix."""

    tokens: list[int]
    slots: torch.Tensor
    last_node: object
    num_cached: int

    def own_slots(self) -> torch.Tensor:
        return self.slots[self.num_cached :]


class Pool:
    """An allocator, a cache and a fake KV buffer that stores each slot's token id."""

    def __init__(self, page_size: int, num_pages: int = 256, cache_cls: type[PrefixCache] = RadixCache):
        self.ps = page_size
        self.alloc = PagedAllocator(num_pages, page_size, CPU)
        self.cache = cache_cls(self.alloc, page_size)
        self.kv = torch.full(((num_pages + 1) * page_size,), -1, dtype=torch.int64)

    def alloc_for(self, req_len: int, last: int, n: int) -> torch.Tensor | None:
        """Slots for ``n`` more tokens, evicting from the cache when the pool is short."""
        slots = alloc_extend(self.alloc, [req_len], [last], [n])
        if slots is None:
            short = self.alloc.pages_needed([req_len], [n]) * self.ps - self.alloc.available_size()
            self.cache.evict(short)
            slots = alloc_extend(self.alloc, [req_len], [last], [n])
        return slots

    def start(self, tokens: list[int]) -> Req | None:
        """Match, lock and allocate the rest, writing the tokens' 'KV'."""
        m = self.cache.match_prefix(tokens)
        assert self.kv[m.slots].tolist() == tokens[: m.num_tokens], "matched prefix has foreign KV"
        assert m.num_tokens % self.ps == 0
        self.cache.inc_lock_ref(m.last_node)
        last = int(m.slots[-1]) if m.num_tokens else -1
        new = self.alloc_for(m.num_tokens, last, len(tokens) - m.num_tokens)
        if new is None:
            self.cache.dec_lock_ref(m.last_node)
            return None
        self.kv[new] = torch.tensor(tokens[m.num_tokens :], dtype=torch.int64)
        return Req(list(tokens), torch.cat([m.slots, new]), m.last_node, m.num_tokens)

    def extend(self, req: Req, tokens: list[int]) -> bool:
        new = self.alloc_for(len(req.tokens), int(req.slots[-1]), len(tokens))
        if new is None:
            return False
        self.kv[new] = torch.tensor(tokens, dtype=torch.int64)
        req.tokens += tokens
        req.slots = torch.cat([req.slots, new])
        return True

    def finish(self, req: Req) -> None:
        assert self.kv[req.slots].tolist() == req.tokens
        self.cache.cache_finished_req(req.tokens, req.slots, req.last_node, req.num_cached)

    def checkpoint(self, req: Req) -> None:
        """cache_unfinished_req, updating the request the way the scheduler does."""
        m = self.cache.cache_unfinished_req(req.tokens, req.slots, req.last_node, req.num_cached)
        req.slots = torch.cat([m.slots, req.slots[m.num_tokens :]])
        req.last_node, req.num_cached = m.last_node, m.num_tokens
        assert self.kv[req.slots].tolist() == req.tokens

    def check(self, running: Sequence[Req] = ()) -> None:
        """free + requests' own pages + cache == total, and each page has one owner."""
        self.cache.check_invariants()
        own = [p for r in running for p in pages(r.own_slots(), self.ps)]
        cached = tree_pages(self.cache)
        assert len(cached) * self.ps == self.cache.total_size()
        assert self.alloc.available_size() + len(own) * self.ps + self.cache.total_size() == self.alloc.size
        owners = list(self.alloc._free_pages) + own + cached
        assert sorted(owners) == list(range(1, self.alloc.num_pages + 1)), "a page is lost or owned twice"


def pages(slots: torch.Tensor, ps: int) -> list[int]:
    return torch.unique(slots // ps).tolist()


def tree_pages(cache: PrefixCache) -> list[int]:
    """The pages of every namespace's tree."""
    if not isinstance(cache, RadixCache):
        return []
    return [page for node in cache._nodes() for page in pages(node.value, cache.page_size)]


def insert_fresh(pool: Pool, tokens: list[int]) -> torch.Tensor:
    """Allocate slots for ``tokens`` and insert them, freeing the ones the tree had."""
    slots = alloc_tokens(pool.alloc, len(tokens))
    pool.kv[slots] = torch.tensor(tokens, dtype=torch.int64)
    pool.alloc.free(slots[: pool.cache.insert(tokens, slots)])
    return slots


# ---------------------------------------------------------------- basic tree


def test_match_full_partial_none():
    pool = Pool(page_size=1)
    slots = insert_fresh(pool, [1, 2, 3, 4])
    cache = pool.cache

    full = cache.match_prefix([1, 2, 3, 4, 5])
    assert full.slots.tolist() == slots.tolist()
    assert full.last_node.key == [1, 2, 3, 4]

    partial = cache.match_prefix([1, 2, 9])
    assert partial.slots.tolist() == slots[:2].tolist()
    assert partial.last_node.key == [1, 2]  # split: [1, 2] -> [3, 4]
    assert [c.key for c in partial.last_node.children.values()] == [[3, 4]]

    none = cache.match_prefix([7, 1, 2])
    assert none.num_tokens == 0 and none.last_node is cache.root
    assert cache.match_prefix([]).num_tokens == 0
    assert cache.total_size() == cache.evictable_size() == 4
    pool.check()


def test_insert_returns_present_prefix_and_branches():
    pool = Pool(page_size=1)
    cache = pool.cache
    insert_fresh(pool, [1, 2, 3])
    dup = alloc_tokens(pool.alloc, 5)
    assert cache.insert([1, 2, 3, 7, 8], dup) == 3
    pool.alloc.free(dup[:3])  # the caller frees the duplicates it learned about
    assert cache.total_size() == 5
    assert cache.match_prefix([1, 2, 3, 7, 8]).slots[3:].tolist() == dup[3:].tolist()
    assert cache.insert([1, 2, 3, 7, 8], dup) == 5  # nothing new: nothing taken
    pool.check()


def test_insert_copies_a_row_view():
    pool = Pool(page_size=1)
    row = torch.zeros(8, dtype=torch.int64)  # as in ReqToTokenPool.req_to_token
    row[:3] = alloc_tokens(pool.alloc, 3)
    kept = row[:3].tolist()
    pool.cache.insert([1, 2, 3], row[:3])
    row[:3] = 0  # the request slot is reused
    assert pool.cache.match_prefix([1, 2, 3]).slots.tolist() == kept
    pool.check()


def test_split_inherits_locks():
    pool = Pool(page_size=1)
    cache = pool.cache
    insert_fresh(pool, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.match_prefix([1, 2, 5])  # splits the locked node
    assert cache.protected_size() == 4
    cache.check_invariants()
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    pool.check()


def test_lock_accounting():
    pool = Pool(page_size=1)
    cache = pool.cache
    insert_fresh(pool, [1, 2, 3, 4])
    insert_fresh(pool, [1, 2, 5, 6, 7])
    a = cache.match_prefix([1, 2, 3, 4]).last_node
    b = cache.match_prefix([1, 2, 5, 6, 7]).last_node
    cache.inc_lock_ref(a)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 3)
    cache.inc_lock_ref(b)
    cache.inc_lock_ref(b)
    assert (cache.protected_size(), cache.evictable_size()) == (7, 0)
    assert a.parent.lock_ref == 3
    cache.dec_lock_ref(b)
    cache.dec_lock_ref(a)
    assert (cache.protected_size(), cache.evictable_size()) == (5, 2)
    cache.dec_lock_ref(b)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 7)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(b)
    cache.inc_lock_ref(cache.root)  # the empty match: a no-op
    assert cache.protected_size() == 0
    pool.check()


def test_namespaces_keep_equal_tokens_apart():
    """The same tokens in two namespaces (KV computed differently: LongRoPE's two
    sets) never match each other; each namespace matches, caches and locks its own,
    while the sizes, eviction and reset span them all."""
    pool = Pool(page_size=2)
    cache = pool.cache
    plain = insert_fresh(pool, [1, 2, 3, 4])
    other = alloc_tokens(pool.alloc, 6)
    pool.kv[other] = torch.tensor([1, 2, 3, 4, 5, 6])
    assert cache.insert([1, 2, 3, 4, 5, 6], other, "other") == 0  # nothing of it was cached there
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == plain.tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6], "other").slots.tolist() == other.tolist()
    empty = cache.match_prefix([1, 2, 3, 4], "third")
    assert empty.num_tokens == 0 and empty.last_node.parent is None and empty.last_node is not cache.root
    assert cache.total_size() == 10

    locked = cache.match_prefix([1, 2, 3, 4], "other").last_node
    cache.inc_lock_ref(locked)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 6)
    assert cache.evict(100) == 6  # the plain tree and the unlocked tail of the other
    assert cache.match_prefix([1, 2, 3, 4], "other").num_tokens == 4
    pool.check()

    # A request of the other namespace caches its pages there, not in the plain tree.
    slots = torch.cat([cache.match_prefix([1, 2, 3, 4], "other").slots, alloc_tokens(pool.alloc, 2)])
    pool.kv[slots[4:]] = torch.tensor([7, 8])
    match = cache.cache_unfinished_req([1, 2, 3, 4, 7, 8], slots, locked, 4, "other")
    assert match.num_tokens == 6 and cache.match_prefix([1, 2, 3, 4, 7, 8]).num_tokens == 0
    assert cache.reset() is False  # still locked
    cache.dec_lock_ref(match.last_node)
    assert cache.reset() and cache.total_size() == 0
    assert cache.match_prefix([1, 2, 3, 4], "other").num_tokens == 0
    pool.check()


# ------------------------------------------------------------------ eviction


def test_evict_lru_order():
    pool = Pool(page_size=1)
    cache = pool.cache
    for first in (10, 20, 30):
        insert_fresh(pool, [first, 1, 2])
    cache.match_prefix([10, 1, 2])  # 10 is now the most recent, 20 the oldest
    assert cache.evict(1) == 3
    assert cache.match_prefix([20, 1, 2]).num_tokens == 0
    assert cache.evict(1) == 3
    assert cache.match_prefix([30, 1, 2]).num_tokens == 0
    assert cache.match_prefix([10, 1, 2]).num_tokens == 3
    pool.check()


def test_evict_never_touches_locked_nodes():
    pool = Pool(page_size=1)
    cache = pool.cache
    insert_fresh(pool, [1, 2, 3])
    insert_fresh(pool, [1, 2, 4, 5])
    insert_fresh(pool, [9, 9])
    locked = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(locked)
    assert cache.evict(100) == 4  # [4, 5] and [9, 9]; [1, 2] stays as [3]'s parent
    assert cache.total_size() == cache.protected_size() == 3
    assert cache.match_prefix([1, 2, 3]).num_tokens == 3
    pool.check()
    cache.dec_lock_ref(locked)
    assert cache.evict(100) == 3 and cache.total_size() == 0
    pool.check()


def test_parent_becomes_leaf_candidate():
    pool = Pool(page_size=1)
    cache = pool.cache
    insert_fresh(pool, [1, 2, 3, 4])
    insert_fresh(pool, [1, 2, 5, 6])
    insert_fresh(pool, [8, 8, 8])
    cache.match_prefix([8, 8, 8])  # the [1, 2] branch is older
    assert cache.evict(5) == 6  # both children, then their parent [1, 2]
    assert cache.match_prefix([1, 2]).num_tokens == 0
    assert cache.match_prefix([8, 8, 8]).num_tokens == 3
    assert cache.evict(0) == 0
    pool.check()


# ----------------------------------------------------------- page alignment


def test_page_aligned_insert_and_match():
    ps = 16
    pool = Pool(page_size=ps)
    cache = pool.cache
    tokens = list(range(100, 140))  # 2 pages + 8 tokens
    slots = alloc_tokens(pool.alloc, len(tokens))
    assert cache.insert(tokens, slots) == 0
    assert cache.total_size() == 32  # the partial page is not cached
    pool.alloc.free(slots[32:])

    assert cache.match_prefix(tokens).slots.tolist() == slots[:32].tolist()
    assert cache.match_prefix(tokens[:31]).num_tokens == 16  # partial pages never match
    assert cache.match_prefix(tokens[:15]).num_tokens == 0
    diverging = tokens[:20] + [0] * 20
    m = cache.match_prefix(diverging)
    assert m.slots.tolist() == slots[:16].tolist()
    assert len(m.last_node.key) == 16 and len(next(iter(m.last_node.children.values())).key) == 16
    assert cache.insert(tokens[:15], slots[:15]) == 0  # nothing aligned to insert
    pool.check()


# ------------------------------------------------------ request-level helpers


@pytest.mark.parametrize("ps", [1, 16])
def test_finished_requests_share_prefix(ps):
    pool = Pool(page_size=ps)
    prompt = list(range(1, 38))
    a = pool.start(prompt)
    assert a.num_cached == 0
    pool.check([a])
    pool.finish(a)
    pool.check()
    assert pool.cache.total_size() == 37 - 37 % ps

    b = pool.start(prompt[:20] + [99] * 10)
    assert b.num_cached == 20 - 20 % ps
    assert b.slots[: b.num_cached].tolist() == a.slots[: b.num_cached].tolist()
    assert pool.cache.protected_size() == b.num_cached
    pool.check([b])
    pool.finish(b)
    assert pool.cache.protected_size() == 0
    pool.check()


@pytest.mark.parametrize("ps", [1, 16])
def test_duplicates_freed_when_two_requests_compute_the_same_prompt(ps):
    pool = Pool(page_size=ps)
    prompt = list(range(50, 90))
    a, b = pool.start(prompt), pool.start(prompt)  # both miss: each computes all 40
    pool.check([a, b])
    free_before = pool.alloc.available_size()
    pool.finish(a)
    pool.finish(b)  # b's aligned slots are duplicates of a's
    pool.check()
    cached = 40 - 40 % ps
    assert pool.cache.total_size() == cached
    assert pool.alloc.available_size() == free_before + 2 * -(-40 // ps) * ps - cached
    assert pool.cache.match_prefix(prompt).slots.tolist() == a.slots[:cached].tolist()


@pytest.mark.parametrize("ps", [1, 16])
def test_chunked_prefill_round_trip(ps):
    pool = Pool(page_size=ps)
    prompt = list(range(200, 250))
    req = pool.start(prompt[:20])
    pool.check([req])
    pool.checkpoint(req)
    assert req.num_cached == 20 - 20 % ps
    assert pool.cache.protected_size() == req.num_cached and pool.cache.evictable_size() == 0
    pool.check([req])

    assert pool.extend(req, prompt[20:])
    pool.checkpoint(req)
    assert req.num_cached == 50 - 50 % ps
    pool.check([req])

    pool.finish(req)
    assert pool.cache.protected_size() == 0 and pool.cache.total_size() == 50 - 50 % ps
    pool.check()


@pytest.mark.parametrize("ps", [1, 16])
def test_checkpoint_adopts_another_requests_slots(ps):
    pool = Pool(page_size=ps)
    prompt = list(range(300, 340))
    a, b = pool.start(prompt), pool.start(prompt)
    pool.finish(a)
    pool.checkpoint(b)  # b's prefix pages are duplicates: freed, replaced by a's
    assert b.slots[: b.num_cached].tolist() == a.slots[: b.num_cached].tolist()
    pool.check([b])
    assert pool.extend(b, [1, 2, 3])
    pool.check([b])
    pool.finish(b)
    pool.check()


def test_reset():
    pool = Pool(page_size=16)
    req = pool.start(list(range(64)))
    pool.checkpoint(req)
    assert not pool.cache.reset()  # locked
    pool.check([req])
    pool.finish(req)
    assert pool.cache.reset()
    assert pool.cache.total_size() == 0 and pool.alloc.available_size() == pool.alloc.size
    assert pool.cache.match_prefix(list(range(64))).num_tokens == 0
    pool.check()


def test_bad_arguments():
    pool = Pool(page_size=16)
    with pytest.raises(ValueError):
        pool.cache.insert([1, 2], torch.tensor([16], dtype=torch.int64))
    req = pool.start(list(range(20)))
    with pytest.raises(ValueError):
        pool.cache.cache_finished_req(req.tokens, req.slots, req.last_node, 3)
    with pytest.raises(ValueError):
        RadixCache(pool.alloc, 1)


# ---------------------------------------------------------------- ChunkCache


@pytest.mark.parametrize("ps", [1, 16])
def test_chunk_cache(ps):
    pool = Pool(page_size=ps, cache_cls=ChunkCache)
    cache = pool.cache
    prompt = list(range(40))
    req = pool.start(prompt)
    assert req.num_cached == 0 and req.last_node is None
    pool.checkpoint(req)  # keeps everything private
    assert req.num_cached == 0 and req.slots.numel() == 40
    other = pool.start(prompt)
    assert other.num_cached == 0
    pool.check([req, other])
    assert cache.evict(10**6) == 0 and cache.total_size() == 0 and cache.reset()
    pool.finish(req)
    pool.finish(other)
    assert pool.alloc.available_size() == pool.alloc.size
    pool.check()


# ---------------------------------------------------------------- randomized


@pytest.mark.parametrize("ps, num_pages", [(1, 300), (16, 24)])
@pytest.mark.parametrize("cache_cls", [RadixCache, ChunkCache])
def test_random_requests_share_prefixes(ps, num_pages, cache_cls):
    rng = random.Random(1234 + ps)
    pool = Pool(page_size=ps, num_pages=num_pages, cache_cls=cache_cls)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(5, 60))] for _ in range(4)]
    running: list[Req] = []
    hits = 0
    for _step in range(600):
        action = rng.random()
        if action < 0.35 or not running:
            prompt = rng.choice(systems)[: rng.randrange(1, 60)] + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 40))
            ]
            if rng.random() < 0.3 and running:  # a follow-up turn of a running conversation
                prompt = rng.choice(running).tokens + prompt[:5]
            req = pool.start(prompt)
            if req is not None:
                hits += req.num_cached > 0
                running.append(req)
        elif action < 0.7:
            req = rng.choice(running)
            if not pool.extend(req, [rng.randrange(1000) for _ in range(rng.choice([1, 1, 1, 7, 20]))]):
                running.remove(req)  # out of memory: finish it early
                pool.finish(req)
        elif action < 0.8:
            pool.checkpoint(rng.choice(running))
        else:
            req = running.pop(rng.randrange(len(running)))
            pool.finish(req)
        pool.check(running)
    for req in running:
        pool.finish(req)
    pool.check()
    if cache_cls is RadixCache:
        assert hits > 20
        assert pool.cache.protected_size() == 0
        pool.cache.evict(pool.alloc.size)
    assert pool.alloc.available_size() == pool.alloc.size


@pytest.mark.parametrize("ps", [1, 4])
def test_cached_len_is_the_match_without_touching_the_tree(ps):
    """``cached_len`` counts what ``match_prefix`` would match, and leaves the tree as
    it was: no split, no access time, no new namespace."""
    rng = random.Random(7 + ps)
    pool = Pool(page_size=ps, num_pages=400)
    cache = pool.cache
    systems = [[rng.randrange(50) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    for _ in range(12):
        insert_fresh(pool, rng.choice(systems)[: rng.randrange(4, 40)] + [rng.randrange(50) for _ in range(9)])

    def tree_state() -> list[tuple[int, tuple[int, ...], int]]:
        return sorted((n.id, tuple(n.key), n.last_access) for n in cache._nodes())

    for _ in range(200):
        query = rng.choice(systems)[: rng.randrange(0, 45)] + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
        before = tree_state()
        counted = cache.cached_len(query)
        assert cache.cached_len(query, namespace=("other",)) == 0
        assert tree_state() == before and set(cache._roots) == {None}
        assert counted == cache.match_prefix(query).num_tokens
    assert ChunkCache(PagedAllocator(8, ps, CPU), ps).cached_len(query) == 0
