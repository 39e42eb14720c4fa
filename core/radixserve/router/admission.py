"""Admission: how many requests the router forwards at once and how fast.

A request is admitted while fewer than ``--max-concurrent-requests`` are in flight and,
with ``--rate-limit-tokens-per-second``, while the token bucket (refilled at that rate,
holding at most ``--max-concurrent-requests`` tokens or one second's worth) has a token.
Otherwise it waits, first come first served, in a queue of ``--queue-size``: 429 when
the queue is full, 408 when it waited ``--queue-timeout-secs``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from radixserve.router.metrics import RouterMetrics
from radixserve.server.errors import APIError


class Admission:
    def __init__(
        self,
        max_concurrent: int,
        rate: float | None,
        queue_size: int,
        queue_timeout: float,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limit = max_concurrent if max_concurrent > 0 else None
        self.rate = rate
        self.burst = float(self.limit or max(1.0, rate or 1.0))
        self.queue_size, self.queue_timeout = queue_size, queue_timeout
        self.metrics, self.clock = metrics, clock
        self.tokens, self.refilled_at = self.burst, clock()
        self.in_flight = 0
        self.waiters: deque[asyncio.Future[None]] = deque()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def enabled(self) -> bool:
        return self.limit is not None or self.rate is not None

    async def acquire(self) -> None:
        if not self.enabled:
            self.in_flight += 1
            return
        self._refill()
        if not self.waiters and self._can_admit():
            self._take()
            return
        if len(self.waiters) >= self.queue_size:
            self.metrics.refused.labels("queue_full").inc()
            raise APIError(
                429, f"too many requests: the admission queue is full ({self.queue_size} waiting)", code="rate_limited"
            )
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(ticket)
        self.metrics.queue_depth.set(len(self.waiters))
        self._wake_later()
        try:
            await asyncio.wait_for(asyncio.shield(ticket), self.queue_timeout)
        except asyncio.TimeoutError:
            if not ticket.done():
                ticket.cancel()
                self.metrics.refused.labels("queue_timeout").inc()
                raise APIError(
                    408,
                    f"the request waited {self.queue_timeout:g} s for admission (--queue-timeout-secs)",
                    code="queue_timeout",
                ) from None
        except asyncio.CancelledError:  # the client left while waiting
            if ticket.done() and not ticket.cancelled():
                self.release()  # admitted just before: give the place back
            ticket.cancel()
            raise
        finally:
            self._forget_done()

    def release(self) -> None:
        self.in_flight -= 1
        if self.enabled:
            self._admit_waiters()

    def _can_admit(self) -> bool:
        return (self.limit is None or self.in_flight < self.limit) and (self.rate is None or self.tokens >= 1)

    def _take(self) -> None:
        self.in_flight += 1
        if self.rate is not None:
            self.tokens -= 1

    def _refill(self) -> None:
        now = self.clock()
        if self.rate is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.refilled_at) * self.rate)
        self.refilled_at = now

    def _admit_waiters(self) -> None:
        self._refill()
        self._forget_done()
        while self.waiters and self._can_admit():
            ticket = self.waiters.popleft()
            self._take()
            ticket.set_result(None)
            self._forget_done()
        self.metrics.queue_depth.set(len(self.waiters))
        self._wake_later()

    def _wake_later(self) -> None:
        """With waiters held back by the rate alone, look again when the next token is due."""
        if self.rate is None or not self.waiters or self._timer is not None or self.tokens >= 1:
            return

        def wake() -> None:
            self._timer = None
            self._admit_waiters()

        delay = (1 - self.tokens) / self.rate
        self._timer = asyncio.get_running_loop().call_later(delay, wake)

    def _forget_done(self) -> None:
        while self.waiters and self.waiters[0].done():
            self.waiters.popleft()
        self.metrics.queue_depth.set(len(self.waiters))
