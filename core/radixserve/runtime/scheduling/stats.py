"""What the scheduler reports: its running totals, its decode throughput, the
stats snapshot behind ``/server_info``, ``/get_load`` and the metrics, and the
operator's log lines (in SGLang's format, so existing dashboards and habits
carry over)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

from radixserve.cache.token_prefix import common_prefix_len
from radixserve.rate_bands import DECODE_BANDS, PREFILL_BANDS, band_index
from radixserve.runtime.execution.request import Req
from radixserve.runtime.scheduling.kv_ledger import PoolCounts

logger = logging.getLogger(__name__)

# How many seconds of steps the decode and prefill throughputs cover.
RATE_WINDOW_S = 30.0


@dataclass
class ServingTotals:
    """Counts since start."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    generation_tokens: int = 0
    retracted_reqs: int = 0
    decode_steps: int = 0
    decoded_reqs: int = 0  # requests advanced by decode steps (a step's batch size, summed)
    extend_steps: int = 0
    extended_tokens: int = 0  # prompt tokens computed by extend steps (chunks, retracted requests' again)
    verify_steps: int = 0  # decode steps that verified proposals (speculative decoding)
    proposed_tokens: int = 0  # tokens proposed to them
    accepted_tokens: int = 0  # of those, the ones the model kept

    def count_admission(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def count_decode(self, batch_size: int) -> None:
        self.decode_steps += 1
        self.decoded_reqs += batch_size

    def count_verified(self, proposed: int, accepted: int) -> None:
        """One request's share of a verify step."""
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted

    def count_extend(self, tokens: int) -> None:
        self.extend_steps += 1
        self.extended_tokens += tokens


class StepRate:
    """Tokens per second of the scheduler's last ``window_s`` seconds of steps of one kind
    (decode: tokens generated; prefill: prompt tokens computed): the worker's recent speed
    at it. Idle time and steps of the other kind do not count, so the figure keeps its
    value while the worker idles; None until such a step has made a token."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._steps: deque[tuple[float, int]] = deque()  # (seconds, tokens) of each counted step, oldest first
        self._seconds = 0.0
        self._tokens = 0

    def add(self, seconds: float, tokens: int) -> None:
        self._steps.append((seconds, tokens))
        self._seconds += seconds
        self._tokens += tokens
        while len(self._steps) > 1 and self._seconds - self._steps[0][0] >= self.window_s:
            old_seconds, old_tokens = self._steps.popleft()
            self._seconds -= old_seconds
            self._tokens -= old_tokens

    @property
    def tokens_per_s(self) -> float | None:
        if not self._tokens or self._seconds <= 0:
            return None
        return self._tokens / self._seconds

    @property
    def tokens_per_step(self) -> float | None:
        return self._tokens / len(self._steps) if self._tokens else None


class StepRates:
    """The decode and prefill ``StepRate``s, fed by timing each scheduler step: the one
    measure of throughput (``decode_tokens_per_s`` and ``prefill_tokens_per_s`` in the stats,
    ``/server_info`` and ``/get_load``; the Decode batch log line); and the same per band of
    batch size (``rate_bands``: a prefill step by the prompt tokens it computes, a decode
    step by the requests it advances), the worker's speed at each size, which a router
    uses to predict latency; and for decode, the tokens those steps gave their requests
    per second (``decode_band_outputs``): one per request a step advances, plus the
    proposals a verify step kept (speculative decoding), so that a router can predict
    the time per output token a request would see. A step costs three list lookups more."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.decode, self.prefill = StepRate(window_s), StepRate(window_s)
        self.decode_bands = [StepRate(window_s) for _ in range(len(DECODE_BANDS) + 1)]
        self.decode_band_outputs = [StepRate(window_s) for _ in range(len(DECODE_BANDS) + 1)]
        self.prefill_bands = [StepRate(window_s) for _ in range(len(PREFILL_BANDS) + 1)]
        # decode steps, generated, requests decoded, proposals kept, extend steps, extended: when the last step ended
        self._seen = (0, 0, 0, 0, 0, 0)

    @contextlib.contextmanager
    def measure(self, totals: ServingTotals) -> Iterator[None]:
        """Time one scheduler step; it counts for the kind of step it launched. With
        overlap scheduling a step digests the tokens of the step before it (the band
        rates count the batch the step launched: one token per request decoded)."""
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        decode_steps, generated, decoded, kept, extend_steps, extended = self._seen
        if totals.decode_steps != decode_steps:
            self.decode.add(seconds, totals.generation_tokens - generated)
            batch = totals.decoded_reqs - decoded
            band = band_index(DECODE_BANDS, batch)
            self.decode_bands[band].add(seconds, batch)
            # With overlap scheduling the proposals kept are the step before's: the same band, in a steady run.
            self.decode_band_outputs[band].add(seconds, batch + totals.accepted_tokens - kept)
        if totals.extend_steps != extend_steps:
            tokens = totals.extended_tokens - extended
            self.prefill.add(seconds, tokens)
            self.prefill_bands[band_index(PREFILL_BANDS, tokens)].add(seconds, tokens)
        self._seen = (
            totals.decode_steps,
            totals.generation_tokens,
            totals.decoded_reqs,
            totals.accepted_tokens,
            totals.extend_steps,
            totals.extended_tokens,
        )


def tokens_to_prefill(waiting: Sequence[Req], cached_len: Callable[[list[int], Hashable], int]) -> int:
    """The prompt tokens the waiting requests will compute: each one's beyond its prefix
    already in the cache and beyond what an earlier one shares with it (the prefill
    planner computes a shared prefix once, ``IN_BATCH_PREFIX_MIN_TOKENS``). A router
    that counted whole prompts would see a prefix group's worker as busier than it is,
    and move the group's next request elsewhere, where its prefix is computed again.

    In sorted order, what a prompt shares with all those before it is what it shares
    with the one just before, so each adds its tokens past both that and its cached part."""
    by_namespace: dict[Hashable, list[list[int]]] = {}
    for req in waiting:
        by_namespace.setdefault(req.cache_namespace, []).append(req.fill_ids)
    total = 0
    for namespace, prompts in by_namespace.items():
        prompts.sort()
        before: list[int] = []
        for ids in prompts:
            total += len(ids) - max(common_prefix_len(before, ids), cached_len(ids, namespace))
            before = ids
    return total


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_queue_reqs: int
    num_waiting_tokens: int  # prompt tokens the waiting requests have to compute (tokens_to_prefill)
    decode_tokens_per_s: float | None  # StepRates'
    prefill_tokens_per_s: float | None
    decode_band_tokens_per_s: list[float | None]  # per rate_bands.DECODE_BANDS band (and the open one)
    decode_band_sizes: list[float | None]  # the mean batch of each band's steps
    decode_band_output_tokens_per_s: list[float | None]  # the tokens those steps gave their requests, per second
    prefill_band_tokens_per_s: list[float | None]  # per rate_bands.PREFILL_BANDS band
    prefill_band_sizes: list[float | None]  # the mean prompt tokens of each band's steps
    token_usage: float
    tokens_in_use: int  # held by requests or locked in the cache (free and evictable ones are not)
    cache_hit_rate: float
    num_retracted_reqs: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generation_tokens_total: int
    max_total_tokens: int
    free_tokens: int
    cached_tokens_in_tree: int
    locked_cached_tokens: int  # cached tokens some request reads (the rest are evictable)
    private_tokens: int
    memory_invariant_ok: bool
    memory_error: str | None  # what breaks the invariant, when it is broken
    # Speculative decoding: steps that verified proposals, tokens proposed, and kept.
    spec_verify_steps: int = 0
    spec_proposed_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0

    @classmethod
    def of(
        cls,
        totals: ServingTotals,
        pool: PoolCounts,
        num_running: int,
        waiting: Sequence[Req],
        waiting_tokens: int,
        rates: StepRates,
    ) -> SchedulerStats:
        in_use = pool.total - pool.free - pool.cached_evictable
        return cls(
            num_running_reqs=num_running,
            num_queue_reqs=len(waiting),
            num_waiting_tokens=waiting_tokens,
            decode_tokens_per_s=rates.decode.tokens_per_s,
            prefill_tokens_per_s=rates.prefill.tokens_per_s,
            decode_band_tokens_per_s=[band.tokens_per_s for band in rates.decode_bands],
            decode_band_sizes=[band.tokens_per_step for band in rates.decode_bands],
            decode_band_output_tokens_per_s=[band.tokens_per_s for band in rates.decode_band_outputs],
            prefill_band_tokens_per_s=[band.tokens_per_s for band in rates.prefill_bands],
            prefill_band_sizes=[band.tokens_per_step for band in rates.prefill_bands],
            token_usage=in_use / pool.total,
            tokens_in_use=in_use,
            cache_hit_rate=totals.cached_tokens / totals.prompt_tokens if totals.prompt_tokens else 0.0,
            num_retracted_reqs=totals.retracted_reqs,
            prompt_tokens_total=totals.prompt_tokens,
            cached_tokens_total=totals.cached_tokens,
            generation_tokens_total=totals.generation_tokens,
            max_total_tokens=pool.total,
            free_tokens=pool.free,
            cached_tokens_in_tree=pool.cached,
            locked_cached_tokens=pool.cached_locked,
            private_tokens=pool.private,
            memory_invariant_ok=pool.ok,
            memory_error=_memory_error(pool),
            spec_verify_steps=totals.verify_steps,
            spec_proposed_tokens_total=totals.proposed_tokens,
            spec_accepted_tokens_total=totals.accepted_tokens,
        )


def _memory_error(pool: PoolCounts) -> str | None:
    if pool.lock_error is not None:
        return f"prefix cache locks: {pool.lock_error}"
    if pool.rows_unaccounted:
        return f"{pool.rows_unaccounted} token table rows leaked"
    if pool.free + pool.private + pool.cached != pool.total:
        return f"free {pool.free} + private {pool.private} + cached {pool.cached} != total {pool.total}"
    return None


class OperatorLog:
    """The Prefill batch / Decode batch INFO lines."""

    def __init__(self, decode_interval: int):
        self.decode_interval = decode_interval

    @staticmethod
    def enabled() -> bool:
        return logger.isEnabledFor(logging.INFO)

    def prefill(self, num_reqs: int, new_tokens: int, cached_tokens: int, stats: SchedulerStats) -> None:
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            num_reqs,
            new_tokens,
            cached_tokens,
            stats.token_usage,
            stats.num_running_reqs,
            stats.num_queue_reqs,
        )

    def due(self, decode_steps: int) -> bool:
        return decode_steps % self.decode_interval == 0

    def decode(self, stats: SchedulerStats) -> None:
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
            "#queue-req: %d",
            stats.num_running_reqs,
            stats.tokens_in_use,
            stats.token_usage,
            stats.decode_tokens_per_s or 0.0,
            stats.num_queue_reqs,
        )
