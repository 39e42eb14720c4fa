"""The KV ledger alone, under random sequences of its verbs (hypothesis).

A state machine admits requests against cached prefixes, allocates chunks and
decode tokens, caches computed prefixes, retracts, finishes, aborts (also
mid-prefill), hands rows back and flushes, with real allocators, token tables
and both prefix caches. After every operation:

- ``counts().ok``: free + private + cached == total, the cache's locks are
  exactly the ones the holders and pins account for, no row leaked;
- page by page, every page is free, cached, or owned by one request, never two;
- every slot a request reads holds the KV of its own prefix (each slot's "KV" is
  recorded as the token prefix it was computed for, and checked on admission).

A directed test leaks a lock on purpose to show the check sees it.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from radixserve.cache.chunk_cache import ChunkCache
from radixserve.cache.memory_pool import PagedAllocator, ReqToTokenPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.runtime.execution.request import Req
from radixserve.runtime.scheduling.kv_ledger import KVLedger
from radixserve.sampling.params import SamplingParams

CPU = torch.device("cpu")
NUM_PAGES = 48
ROWS = 6
MAX_CONTEXT = 96
# Prompts share heads drawn from a few stems, so matches, splits and evictions happen.
STEMS = [[7] * 20, [7] * 8 + [9] * 12, [3, 1, 4, 1, 5, 9, 2, 6] * 3]


class LedgerMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 4]), radix=st.booleans(), seed=st.integers(0, 2**16))
    def setup(self, page_size: int, radix: bool, seed: int) -> None:
        self.ps = page_size
        self.allocator = PagedAllocator(NUM_PAGES, page_size, CPU)
        self.table = ReqToTokenPool(ROWS, MAX_CONTEXT + page_size, CPU)
        cache = (RadixCache if radix else ChunkCache)(self.allocator, page_size)
        self.ledger = KVLedger(self.allocator, self.table, cache)
        self.rng = random.Random(seed)
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix its KV was computed for
        self.waiting: list[Req] = []
        self.admitted: list[Req] = []
        self.count = 0

    # ---- requests come and go --------------------------------------------------
    @rule(stem=st.integers(0, len(STEMS) - 1), head=st.integers(0, 24), tail=st.integers(1, 30))
    def arrive(self, stem: int, head: int, tail: int) -> None:
        prompt = STEMS[stem][:head] + [self.rng.randrange(10, 60) for _ in range(tail)]
        self.count += 1
        self.waiting.append(Req(rid=f"r{self.count}", origin_input_ids=prompt, sampling_params=SamplingParams()))

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 99), admit=st.booleans())
    def weigh(self, pick: int, admit: bool) -> None:
        """Pin a waiting request's match, then admit it or (rejected) unpin it."""
        req = self.waiting[pick % len(self.waiting)]
        match = self.ledger.match(req.fill_ids[: req.seq_len - 1])
        self.ledger.pin(match)
        if not admit or self.ledger.free_rows() == 0:
            self.ledger.unpin(match)
            return
        self.ledger.admit(req, match)
        self.waiting.remove(req)
        self.admitted.append(req)
        for i, slot in enumerate(match.slots.tolist()):
            assert self.kv[slot] == tuple(req.fill_ids[: i + 1]), "a cached slot holds another prefix's KV"

    @precondition(lambda self: self.admitted)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 40), cache_it=st.booleans(), fails=st.integers(0, 4))
    def step(self, pick: int, chunk: int, cache_it: bool, fails: int) -> None:
        """One request computes a prefill chunk (or its one decode token), if it fits;
        a completed sequence samples its next token. One time in five the step's batch
        fails once it has written the slots into the row: the slots go back, and the
        request is as it was."""
        req = self.admitted[pick % len(self.admitted)]
        span = req.kv
        n = min(chunk, req.seq_len - span.kv_len)
        if n == 0 or req.seq_len >= MAX_CONTEXT:
            return
        if self.ledger.pages_needed([span.kv_len], [n]) * self.ps > self.ledger.room():
            return
        start = span.kv_len

        def record(slots: list[int]) -> list[int]:  # what the step's batch does with them
            self.table.write(span.row, start, torch.tensor(slots))
            if fails == 0:
                raise RuntimeError("the batch failed")
            return slots

        if fails == 0:
            with pytest.raises(RuntimeError, match="the batch failed"):
                self.ledger.allocate([req], [n], record)
            assert span.kv_len == start
            return
        slots = self.ledger.allocate([req], [n], record)
        assert span.kv_len == start + n
        for i, slot in enumerate(slots):
            self.kv[slot] = tuple(req.fill_ids[: start + i + 1])
        if cache_it:
            self.ledger.cache_prefix(req, span.kv_len)
        if span.kv_len == req.seq_len:
            req.output_ids.append(self.rng.randrange(10, 60))

    @precondition(lambda self: self.admitted)
    @rule(pick=st.integers(0, 99), how=st.sampled_from(["finish", "retract", "abort"]))
    def end(self, pick: int, how: str) -> None:
        req = self.admitted.pop(pick % len(self.admitted))
        if how == "abort":
            self.ledger.discard(req)
        else:
            self.ledger.release(req)
        if how == "retract":  # back in line, to resume from prompt + output so far
            self.waiting.insert(0, req)
        assert req.kv is None

    @rule()
    def step_boundary(self) -> None:
        self.ledger.reuse_rows(self.ledger.take_released_rows())

    @precondition(lambda self: not self.admitted)
    @rule()
    def flush(self) -> None:
        assert self.ledger.flush()
        self.kv.clear()
        assert self.allocator.available_size(wait=True) == self.ledger.total

    # ---- what must hold after every operation ------------------------------------
    @invariant()
    def pool_balances(self) -> None:
        counts = self.ledger.counts()
        assert counts.ok, counts
        assert counts.private == sum(-(-r.kv.kv_len // self.ps) * self.ps - r.kv.num_cached for r in self.admitted)
        self.ledger.cache.check_invariants()

    @invariant()
    def every_page_has_one_owner(self) -> None:
        ps = self.ps
        owners: dict[int, str] = {}

        def own(pages: list[int], who: str) -> None:
            for page in pages:
                assert page not in owners, f"page {page} owned by {owners[page]} and {who}"
                owners[page] = who

        own(self.allocator.free_page_ids(), "the free list")
        if isinstance(self.ledger.cache, RadixCache):
            for node in self.ledger.cache._nodes():
                own(sorted({s // ps for s in node.value.tolist()}), "the cache")
        for req in self.admitted:
            own_slots = self.table.req_to_token[req.kv.row, req.kv.num_cached : req.kv.kv_len].tolist()
            own(sorted({s // ps for s in own_slots}), req.rid)
        assert sorted(owners) == list(range(1, NUM_PAGES + 1)), "a page has no owner"


def runs(n: int) -> settings:
    return settings(max_examples=n, stateful_step_count=80, deadline=None, suppress_health_check=list(HealthCheck))


def test_ledger_keeps_the_pool_under_random_operations():
    """100 runs of up to 80 operations: several thousand ledger verbs per CI run."""
    run_state_machine_as_test(LedgerMachine, settings=runs(100))


def test_a_leaked_lock_breaks_the_invariant():
    """An abort that leaves its cached prefix locked (the bug the old count missed:
    a locked page is still a "cached" page) shows at once, and blocks a flush."""
    allocator = PagedAllocator(NUM_PAGES, 4, CPU)
    table = ReqToTokenPool(ROWS, MAX_CONTEXT, CPU)
    ledger = KVLedger(allocator, table, RadixCache(allocator, 4))
    prompt = list(range(10, 30))

    def admit_and_compute() -> Req:
        req = Req(rid="r", origin_input_ids=prompt, sampling_params=SamplingParams())
        match = ledger.match(prompt[:-1])
        ledger.pin(match)
        ledger.admit(req, match)
        n = req.seq_len - req.kv.kv_len
        row, start = req.kv.row, req.kv.kv_len
        ledger.allocate([req], [n], lambda slots: table.write(row, start, torch.tensor(slots)))
        return req

    ledger.release(admit_and_compute())  # its pages go to the cache
    second = admit_and_compute()
    assert second.kv.num_cached == 16 and ledger.counts().ok
    ledger.cache.inc_lock_ref(second.kv.last_node)  # discard's unlock then leaves one lock behind
    ledger.discard(second)
    counts = ledger.counts()
    assert counts.free + counts.private + counts.cached == counts.total, "the page count alone cannot see it"
    assert not counts.ok and "lock_ref 1, requests pin it 0 times" in counts.lock_error
    assert not ledger.flush()
