"""Which waiting requests a step prefills, and how much of each.

``PrefillPlanner.plan`` reads the queues and the KV ledger's room and returns a
``PrefillPlan``; the scheduler applies it (admits the requests, updates its
queues). The only KV state the planner touches is the pin on each admitted
request's matched prefix, taken before its cost is weighed (a pinned prefix
stops counting as evictable room) and handed over with the plan.

Budget: a new request is admitted while its pages, plus the decode tokens it is
expected to need (``new_token_ratio`` of its remaining budget), fit in the free
and evictable KV left after the running requests' own expected decode tokens.
"""

from __future__ import annotations

import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import cast

from radixserve.cache.base import MatchResult
from radixserve.config import ServerArgs
from radixserve.runtime.execution.request import KVSpan, Req
from radixserve.runtime.scheduling.kv_ledger import KVLedger
from radixserve.runtime.scheduling.policy import order_waiting

# Cap on the decode tokens reserved per request when admitting new ones, so a
# huge max_new_tokens does not block admission (SGLang uses the same idea).
RESERVE_CLIP = 4096

# A waiting request that shares at least this many not-yet-cached tokens with a
# request being prefilled this step waits one step and then reads them from the
# cache (SGLang's in-batch prefix caching uses the same threshold).
IN_BATCH_PREFIX_MIN_TOKENS = 32

# Multi-LoRA: a request whose adapter has found no device slot for this long reserves
# the next one. Until it gets it, only requests of its adapter or of the base model are
# admitted, so the adapters in use drain; without that, requests of adapters in use
# that keep arriving would hold every slot for ever.
LORA_SLOT_WAIT_LIMIT = 2.0  # seconds


@dataclass
class Admission:
    """A waiting request admitted this step against its (pinned) cached prefix."""

    req: Req
    match: MatchResult


@dataclass
class PrefillPlan:
    """One step's prefill: ``reqs[i]`` computes ``extend_lens[i]`` more prompt
    tokens (a continued chunked request first, then the ``admitted`` ones).
    ``chunked`` is the request whose prompt is unfinished after this step;
    ``out_of_memory`` a chunked request that can never fit and must end."""

    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    admitted: list[Admission] = field(default_factory=list)
    chunked: Req | None = None
    out_of_memory: Req | None = None

    def add(self, req: Req, extend_len: int) -> None:
        self.reqs.append(req)
        self.extend_lens.append(extend_len)


@dataclass(frozen=True)
class QueueView:
    """What the planner reads of the scheduler's queues."""

    waiting: list[Req]
    running: list[Req]
    chunked: Req | None
    uncached_prefills: list[Req]  # requests of prefill steps not digested yet: their prompts are not cached yet
    new_token_ratio: float
    # The LoRA adapters of the requests holding KV (running, chunked, awaiting a prefill worker's KV).
    adapters: frozenset[int] = frozenset()


def match_limit(req: Req) -> int:
    """How much of a request's tokens may come from the cache: all but the last (its
    logits pick the next token, or its hidden state is an embedding), none from
    ``logprob_start_len`` on when prompt logprobs must be computed, and none for a
    mean-pooled embedding (a cached token has KV but no hidden state to pool)."""
    if req.pooling == "mean":
        return 0
    limit = req.seq_len - 1
    if req.wants_input_logprobs:
        limit = min(limit, req.logprob_start_len - 1)
    return max(limit, 0)


class PrefillPlanner:
    def __init__(self, args: ServerArgs, ledger: KVLedger, max_running: int):
        self.args = args
        self.ledger = ledger
        self.max_running = max_running
        # Multi-LoRA serving: the adapters the admitted requests may use at once (the device slots).
        self.max_adapters = args.max_loras_per_batch if args.enable_lora else None
        self.slot_wait_limit = LORA_SLOT_WAIT_LIMIT

    def plan(self, queues: QueueView) -> PrefillPlan:
        """Continue the chunked request first; then admit waiting requests in policy
        order while rows, the prefill and chunk budgets and the KV room allow."""
        plan = PrefillPlan(chunked=queues.chunked)
        if not queues.waiting and queues.chunked is None:
            return plan
        chunk_left = self.args.chunk_size if self.args.chunk_size is not None else float("inf")
        prefill_left = self.args.max_prefill_tokens
        reserved = self._reserved_decode_tokens(queues) * self.args.schedule_conservativeness
        committed = 0.0

        if queues.chunked is not None:
            req = queues.chunked
            span = cast(KVSpan, req.kv)  # admitted when its first chunk was planned
            extend_len = self._chunk_len(req.seq_len - span.kv_len, chunk_left)
            pages = self.ledger.pages_needed([span.kv_len], [extend_len]) * self.ledger.page_size
            if pages > self.ledger.room():
                # Already admitted, so it waits for room rather than being judged
                # against new-request budgets; alone, it can never fit.
                if not queues.running:
                    plan.chunked, plan.out_of_memory = None, req
                return plan
            chunk_left -= extend_len
            prefill_left -= extend_len
            committed += pages
            plan.add(req, extend_len)
            if span.kv_len + extend_len < req.seq_len:
                return plan
            plan.chunked = None
            if chunk_left <= 0:
                return plan

        adapters = set(queues.adapters)
        starved = self._starved_adapter(queues.waiting, adapters)
        for req in order_waiting(queues.waiting, self.args.schedule_policy, self._prefix_len):
            if len(queues.running) + len(plan.reqs) >= self.max_running:
                break
            if starved is not None and req.lora_id not in (None, starved):
                continue  # the next free slot is the starved adapter's
            if not adapter_fits(req, adapters, self.max_adapters):
                continue  # its adapter would be one too many; requests of adapters in use go on
            if self.ledger.free_rows() <= len(plan.admitted) or min(prefill_left, chunk_left) <= 0:
                break
            limit = match_limit(req)
            match = self.ledger.match(req.fill_ids[:limit], req.cache_namespace)
            prefix = match.num_tokens
            if self.ledger.caches_prefixes and _shares_uncached_prefix(
                req, prefix, limit, plan.reqs + queues.uncached_prefills
            ):
                continue  # next step it finds that prefix in the cache instead of computing it again
            remaining = req.seq_len - prefix
            extend_len = self._chunk_len(remaining, min(chunk_left, prefill_left))
            if extend_len <= 0:
                break
            self.ledger.pin(match)
            pages = self.ledger.pages_needed([prefix], [extend_len]) * self.ledger.page_size
            reserve = min(req.remaining_new_tokens, RESERVE_CLIP) * queues.new_token_ratio
            cost = pages + (reserve if extend_len == remaining else 0)
            room = self.ledger.room() - reserved - committed
            # With nothing else running, admit whenever the tokens themselves fit.
            alone = not plan.reqs and not queues.running
            if cost > room and not (alone and pages <= room + reserved):
                self.ledger.unpin(match)
                break
            committed += cost
            prefill_left -= extend_len
            chunk_left -= extend_len
            plan.admitted.append(Admission(req, match))
            plan.add(req, extend_len)
            if req.lora_id is not None:
                adapters.add(req.lora_id)
            if extend_len < remaining:
                plan.chunked = req
                break
        return plan

    def _starved_adapter(self, waiting: list[Req], adapters: AbstractSet[int]) -> int | None:
        """The adapter of the longest-waiting request that has found no device slot for
        ``slot_wait_limit`` seconds (None: no such request, or LoRA off)."""
        if self.max_adapters is None:
            return None
        now = time.perf_counter()
        starving = [
            r
            for r in waiting
            if now - r.arrival_time > self.slot_wait_limit and not adapter_fits(r, adapters, self.max_adapters)
        ]
        return min(starving, key=lambda r: r.arrival).lora_id if starving else None

    def _prefix_len(self, req: Req) -> int:
        return self.ledger.match(req.fill_ids[: match_limit(req)], req.cache_namespace).num_tokens

    def _reserved_decode_tokens(self, queues: QueueView) -> float:
        reqs = queues.running + ([queues.chunked] if queues.chunked else [])
        return sum(min(r.remaining_new_tokens, RESERVE_CLIP) * queues.new_token_ratio for r in reqs)

    def _chunk_len(self, remaining: int, left: float) -> int:
        if remaining <= left:
            return remaining
        n = int(left)
        if self.ledger.page_size > 1 and self.ledger.caches_prefixes:
            n -= n % self.ledger.page_size  # chunks end on pages so the cache can take them
        return max(n, 0)


def adapter_fits(req: Req, adapters: AbstractSet[int], limit: int | None) -> bool:
    """Whether admitting ``req`` keeps the LoRA adapters of the admitted requests
    (``adapters``) within ``limit`` (the device slots; None: LoRA off)."""
    if limit is None or req.lora_id is None or req.lora_id in adapters:
        return True
    return len(adapters) < limit


def _shares_uncached_prefix(req: Req, cached: int, limit: int, selected: list[Req]) -> bool:
    """Whether ``req`` would find more of its first ``limit`` tokens in the cache after ``selected``."""
    end = cached + IN_BATCH_PREFIX_MIN_TOKENS
    if req.seq_len < end or limit <= cached:
        return False
    head = req.fill_ids[:end]
    return any(
        other.seq_len >= end and other.cache_namespace == req.cache_namespace and other.fill_ids[:end] == head
        for other in selected
    )
