"""Sends a request set through one ``send`` coroutine, all at once, at a Poisson
rate, and/or under a concurrency cap, and times the whole run."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from radixserve.bench.datasets import BenchRequest
from radixserve.bench.metrics import RequestResult

Send = Callable[[BenchRequest], Awaitable[RequestResult]]


@dataclass
class Arrivals:
    request_rate: float = math.inf  # requests/s, Poisson; inf: all at once
    max_concurrency: int | None = None  # requests in flight at most
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 (inf for all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")

    def delays(self, count: int) -> list[float]:
        """The wait before each send: none before the first (the run starts with it),
        then exponential gaps with mean 1/rate, so arrivals are Poisson."""
        if math.isinf(self.request_rate) or count == 0:
            return [0.0] * count
        gaps = np.random.default_rng([self.seed, 2]).exponential(1.0 / self.request_rate, size=count - 1)
        return [0.0, *gaps.tolist()]


async def run_requests(
    requests: list[BenchRequest], send: Send, arrivals: Arrivals, progress: Callable[[], None] | None = None
) -> tuple[list[RequestResult], float]:
    """The results in request order and the run's duration (first send -> last finish)."""
    limit = asyncio.Semaphore(arrivals.max_concurrency) if arrivals.max_concurrency else None

    async def one(request: BenchRequest) -> RequestResult:
        if limit is None:
            result = await send(request)
        else:
            async with limit:
                result = await send(request)
        if progress is not None:
            progress()
        return result

    start = time.perf_counter()
    tasks = []
    for request, delay in zip(requests, arrivals.delays(len(requests)), strict=True):
        if delay:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start
