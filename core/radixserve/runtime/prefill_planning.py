"""Prefill planning: which waiting requests a step prefills, and how much of
each, within the KV that is free (or evictable) after what running requests
are expected to decode. A mixin of ``Scheduler``: it reads the scheduler's
queues, cache and budgets, and admits through ``Scheduler._start``."""

from __future__ import annotations

from radixserve.messages import FinishReason
from radixserve.runtime.policy import order_waiting
from radixserve.runtime.req import Req

# Cap on the decode tokens reserved per request when admitting new ones, so a
# huge max_new_tokens does not block admission (SGLang uses the same idea).
RESERVE_CLIP = 4096

# A waiting request that shares at least this many not-yet-cached tokens with a
# request being prefilled this step waits one step and then reads them from the
# cache (SGLang's in-batch prefix caching uses the same threshold).
IN_BATCH_PREFIX_MIN_TOKENS = 32


def _shares_uncached_prefix(req: Req, cached: int, selected: list[Req]) -> bool:
    end = cached + IN_BATCH_PREFIX_MIN_TOKENS
    if req.seq_len < end:
        return False
    head = req.fill_ids[:end]
    return any(other.seq_len >= end and other.fill_ids[:end] == head for other in selected)


class PrefillPlanning:
    def _match_limit(self, req: Req) -> int:
        # Leave one token to compute (its logits pick the next token), and stop
        # at logprob_start_len when prompt logprobs must be computed.
        limit = req.seq_len - 1
        if req.wants_input_logprobs:
            limit = min(limit, req.logprob_start_len - 1)
        return max(limit, 0)

    def _prefix_len(self, req: Req) -> int:
        return len(self.tree.match_prefix(req.fill_ids[: self._match_limit(req)]).slots)

    def _reserved_decode_tokens(self) -> float:
        reqs = self.running + ([self.chunked_req] if self.chunked_req else [])
        return sum(min(r.remaining_new_tokens, RESERVE_CLIP) * self.new_token_ratio for r in reqs)

    def _schedule_extend(self) -> list[Req]:
        """Pick the requests to prefill this step (continuing a chunked one first),
        within the free KV (allocator + evictable cache) minus what running
        requests are expected to decode (``new_token_ratio`` of their budget)."""
        if not self.waiting and self.chunked_req is None:
            return []
        ps = self.page_size
        chunk_left = self.args.chunk_size if self.args.chunk_size is not None else float("inf")
        prefill_left = self.args.max_prefill_tokens
        reserved = self._reserved_decode_tokens() * self.args.schedule_conservativeness
        committed = 0.0
        selected: list[Req] = []

        if self.chunked_req is not None:
            req = self.chunked_req
            req.extend_len = self._chunk_len(req.seq_len - req.kv_len, chunk_left)
            pages = self._pages(req.kv_len, req.extend_len) * ps
            if pages > self.allocator.available_size() + self.tree.evictable_size():
                # Already admitted, so it waits for room rather than being
                # judged against new-request budgets; alone, it can never fit.
                req.extend_len = 0
                if not self.running:
                    self.chunked_req = None
                    self._release(req)
                    self._finish(
                        req,
                        FinishReason(type="abort", matched=None, message="out of KV cache memory for a single request"),
                    )
                return []
            chunk_left -= req.extend_len
            prefill_left -= req.extend_len
            committed += pages
            selected.append(req)
            if chunk_left <= 0 or req.kv_len + req.extend_len < req.seq_len:
                return selected

        for req in order_waiting(self.waiting, self.args.schedule_policy, self._prefix_len):
            if len(self.running) + len(selected) >= self.max_running:
                break
            if self.req_to_token_pool.available_size() == 0 or min(prefill_left, chunk_left) <= 0:
                break
            match = self.tree.match_prefix(req.fill_ids[: self._match_limit(req)])
            prefix = len(match.slots)
            if self.caches_prefixes and _shares_uncached_prefix(req, prefix, selected + self._uncached_prefills()):
                continue  # next step it finds that prefix in the cache instead of computing it again
            remaining = req.seq_len - prefix
            extend_len = self._chunk_len(remaining, min(chunk_left, prefill_left))
            if extend_len <= 0:
                break
            # Pin the prefix first, so what it held stops counting as evictable room.
            self._lock(match.last_node)
            pages = self._pages(prefix, extend_len) * ps
            reserve = min(req.remaining_new_tokens, RESERVE_CLIP) * self.new_token_ratio
            cost = pages + (reserve if extend_len == remaining else 0)
            room = self.allocator.available_size() + self.tree.evictable_size() - reserved - committed
            # With nothing else running, admit whenever the tokens themselves fit.
            alone = not selected and not self.running
            if cost > room and not (alone and pages <= room + reserved):
                self._unlock(match.last_node)
                break
            committed += cost
            prefill_left -= extend_len
            chunk_left -= extend_len
            self._start(req, match)
            req.extend_len = extend_len
            self.waiting.remove(req)
            selected.append(req)
            if extend_len < remaining:
                self.chunked_req = req
                break
        return selected

    def _chunk_len(self, remaining: int, left: float) -> int:
        if remaining <= left:
            return remaining
        n = int(left)
        if self.page_size > 1 and self.caches_prefixes:
            n -= n % self.page_size  # chunks end on pages so the cache can take them
        return max(n, 0)

    def _pages(self, prefix: int, n: int) -> int:
        return self.allocator.pages_needed([prefix], [n])
