"""The KV pool seen from a test: is everything a request held given back?

The same question is asked of a live server (``/get_server_info`` and
``/flush_cache``), an offline ``Engine`` and an in-process ``Scheduler``, through
a ``Pool`` view. ``assert_whole_pool_back`` is the one place that decides what
"the whole pool is back" means, for every abort, disconnect and stress test.
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx
from helpers_server import wait_until


class Pool(Protocol):
    settle_s: float  # how long requests may take to settle after the test's last action

    def stats(self) -> dict[str, Any]:
        """The scheduler's stats (``SchedulerStats`` fields), plus ``num_in_flight``
        where requests can be in flight between the client and the scheduler."""

    def flush(self) -> bool:
        """Empty the prefix cache; False when the scheduler refuses (work left, or a locked node)."""


class ServerPool:
    settle_s = 20.0

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        self.url, self.headers = url, headers or {}

    def stats(self) -> dict[str, Any]:
        info = httpx.get(self.url + "/get_server_info", headers=self.headers, timeout=30).json()
        return {**info["stats"], "num_in_flight": info["num_in_flight"]}

    def flush(self) -> bool:
        return httpx.post(self.url + "/flush_cache", headers=self.headers, timeout=30).status_code == 200


class ReplicaPool(ServerPool):
    """One data-parallel replica of a live server: its own scheduler stats (from
    ``/get_server_info``'s ``replicas``) with the server's ``num_in_flight``; the
    flush is the server's, which spans every replica."""

    def __init__(self, url: str, dp_rank: int, headers: dict[str, str] | None = None):
        super().__init__(url, headers)
        self.dp_rank = dp_rank

    def stats(self) -> dict[str, Any]:
        info = httpx.get(self.url + "/get_server_info", headers=self.headers, timeout=30).json()
        return {**info["replicas"][self.dp_rank]["stats"], "num_in_flight": info["num_in_flight"]}


class EnginePool:
    settle_s = 20.0

    def __init__(self, engine):
        self.engine = engine

    def stats(self) -> dict[str, Any]:
        return {**self.engine.server_info()["stats"], "num_in_flight": self.engine.tokenizer_manager.num_in_flight}

    def flush(self) -> bool:
        return self.engine.flush_cache()


class SchedulerPool:
    """A scheduler driven by the test itself: nothing is in flight outside it,
    and nothing changes until the test steps it."""

    settle_s = 0.0

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def stats(self) -> dict[str, Any]:
        return {**self.scheduler.stats().__dict__, "num_in_flight": 0}

    def flush(self) -> bool:
        return self.scheduler.flush_cache()


def stats(url: str) -> dict[str, Any]:
    """A server's scheduler stats and ``num_in_flight``."""
    return ServerPool(url).stats()


def idle(s: dict[str, Any]) -> bool:
    """Nothing runs, waits or is in flight, no request holds KV or locks a cached
    prefix, and the KV ledger's invariant holds (free + private + cached == total,
    every cache lock accounted for by a request, no token-table row leaked)."""
    busy = (s["num_running_reqs"], s["num_queue_reqs"], s["private_tokens"], s["locked_cached_tokens"])
    return busy == (0, 0, 0, 0) and s["num_in_flight"] == 0 and s["memory_invariant_ok"]


def assert_whole_pool_back(pool: Pool) -> None:
    """Once the requests settle, the pool is whole: a flush empties the prefix
    cache (it refuses while a request still locks a cached prefix) and the
    allocator's free count is the pool's size.

    The flush shows more than ``idle`` does: the cached pages really go back to
    the allocator."""
    assert wait_until(lambda: idle(pool.stats()), pool.settle_s), f"the requests did not settle: {pool.stats()}"
    assert pool.flush(), f"the cache cannot be flushed: a request still holds part of it: {pool.stats()}"
    after = pool.stats()
    assert after["cached_tokens_in_tree"] == 0, after
    assert after["free_tokens"] == after["max_total_tokens"], f"KV leaked: {after}"
