"""What the scheduler reports: its running totals, the stats snapshot behind
``/get_server_info`` and the metrics, and the operator's log lines (in SGLang's
format, so existing dashboards and habits carry over)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from radixserve.runtime.kv_ledger import PoolCounts

logger = logging.getLogger(__name__)


@dataclass
class ServingTotals:
    """Counts since start."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    generation_tokens: int = 0
    retracted_reqs: int = 0
    decode_steps: int = 0


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_queue_reqs: int
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
    def of(cls, totals: ServingTotals, pool: PoolCounts, num_running: int, num_queued: int) -> "SchedulerStats":
        in_use = pool.total - pool.free - pool.cached_evictable
        return cls(
            num_running_reqs=num_running,
            num_queue_reqs=num_queued,
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
        self._last_decode = (time.perf_counter(), 0)  # time, generation tokens then

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
        now, tokens = time.perf_counter(), stats.generation_tokens_total
        then, before = self._last_decode
        self._last_decode = (now, tokens)
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
            "#queue-req: %d",
            stats.num_running_reqs,
            stats.tokens_in_use,
            stats.token_usage,
            (tokens - before) / max(now - then, 1e-9),
            stats.num_queue_reqs,
        )
