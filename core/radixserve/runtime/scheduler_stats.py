"""What the scheduler reports: its running totals, its decode throughput, the
stats snapshot behind ``/server_info``, ``/get_load`` and the metrics, and the
operator's log lines (in SGLang's format, so existing dashboards and habits
carry over)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from radixserve.runtime.kv_ledger import PoolCounts
from radixserve.runtime.req import Req

logger = logging.getLogger(__name__)

# How many seconds of decode steps the decode throughput covers.
DECODE_RATE_WINDOW_S = 30.0


@dataclass
class ServingTotals:
    """Counts since start."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    generation_tokens: int = 0
    retracted_reqs: int = 0
    decode_steps: int = 0


class DecodeRate:
    """Generation tokens per second of the scheduler's last ``window_s`` seconds
    of decode steps: the worker's recent decode speed. Idle time and steps that
    launch no decode do not count, so the figure keeps its value while the
    worker idles; None until a decode step has generated a token. The one
    measure of generation throughput: ``decode_tokens_per_s`` in the stats
    (``/server_info``, ``/get_load``) and the Decode batch log line."""

    def __init__(self, window_s: float = DECODE_RATE_WINDOW_S):
        self.window_s = window_s
        self._steps: deque[tuple[float, int]] = deque()  # (seconds, tokens) of each counted step, oldest first
        self._seconds = 0.0
        self._tokens = 0
        self._generated = 0  # the generation total when the last step ended
        self._decode_steps = 0  # the decode step count then

    @contextlib.contextmanager
    def measure(self, totals: ServingTotals) -> Iterator[None]:
        """Time one scheduler step; it counts if it launched a decode step. With
        overlap scheduling a step digests the tokens of the step before it."""
        started = time.perf_counter()
        yield
        tokens, self._generated = totals.generation_tokens - self._generated, totals.generation_tokens
        if totals.decode_steps == self._decode_steps:
            return
        self._decode_steps = totals.decode_steps
        self._add(time.perf_counter() - started, tokens)

    def _add(self, seconds: float, tokens: int) -> None:
        self._steps.append((seconds, tokens))
        self._seconds += seconds
        self._tokens += tokens
        while len(self._steps) > 1 and self._seconds - self._steps[0][0] >= self.window_s:
            old_seconds, old_tokens = self._steps.popleft()
            self._seconds -= old_seconds
            self._tokens -= old_tokens

    @property
    def tokens_per_s(self) -> Optional[float]:
        if not self._tokens or self._seconds <= 0:
            return None
        return self._tokens / self._seconds


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_queue_reqs: int
    num_waiting_tokens: int  # tokens the waiting requests have to prefill
    decode_tokens_per_s: Optional[float]  # DecodeRate's
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
    memory_error: Optional[str]  # what breaks the invariant, when it is broken

    @classmethod
    def of(
        cls, totals: ServingTotals, pool: PoolCounts, num_running: int, waiting: Sequence[Req], rate: DecodeRate
    ) -> "SchedulerStats":
        in_use = pool.total - pool.free - pool.cached_evictable
        return cls(
            num_running_reqs=num_running,
            num_queue_reqs=len(waiting),
            num_waiting_tokens=sum(r.seq_len for r in waiting),
            decode_tokens_per_s=rate.tokens_per_s,
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
        )


def _memory_error(pool: PoolCounts) -> Optional[str]:
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
