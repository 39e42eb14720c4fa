"""The router's HTTP client to its workers: one pooled aiohttp session for the
forwarded requests and the probes (health, load, registration, cache flushes).

Why aiohttp: the client is most of what the router does per request. Profiled with
py-spy in front of one tiny worker (600 small completions at concurrency 16), httpx's
client was 47% of the router's CPU; with aiohttp the router's CPU per request fell from
1.73 to 0.75 ms (``benchmarks/profile_router.py``, docs/benchmarks.md P15b).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

# Seconds an idle pooled connection to a worker is kept: below the 5 s keep-alive that
# uvicorn gives SGLang and vLLM workers by default (radixserve's own keep theirs 120 s).
# A connection must be dropped by the router before the worker closes it: a request
# written as the worker closes the connection is lost, and a POST is not retried by aiohttp.
UPSTREAM_KEEPALIVE_S = 4.0

# The errors a try at a worker can end with: no connection, a broken answer, a timeout.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


class UpstreamError(Exception):
    """A worker could not be reached or did not answer in time."""

    def __init__(self, exc: BaseException):
        super().__init__(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        self.timed_out = isinstance(exc, asyncio.TimeoutError)


@dataclass(frozen=True)
class Reply:
    """A probe's whole answer."""

    status: int
    body: bytes

    def json(self) -> Any:
        """The body as JSON; None when it is not."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


class Upstream:
    """Keep-alive connections to every worker, without a limit on their number (the
    router's admission control bounds the requests in flight). ``start`` and ``close``
    run in the server's event loop (the session belongs to it)."""

    def __init__(self, request_timeout_s: float, connect_timeout_s: float = 5.0):
        # Like the workers' own streams: no bound on a whole answer, one on each wait for bytes.
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=request_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S), timeout=self._timeout
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router's upstream client is not started")
        return self._session

    async def open(self, method: str, url: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Send a request and return once the answer's head has come; its body is the
        caller's to read, then to ``release`` (the connection goes back to the pool) or
        ``close`` (the connection is dropped: the worker sees the client gone)."""
        try:
            return await self.session.request(method, url, data=body, headers=headers)
        except TRANSPORT_ERRORS as exc:
            raise UpstreamError(exc) from None

    async def get(self, url: str, headers: dict[str, str], timeout_s: float) -> Reply:
        return await self._whole("GET", url, headers, timeout_s)

    async def post(self, url: str, headers: dict[str, str], timeout_s: float, body: Any = None) -> Reply:
        """``body``: sent as JSON when given."""
        return await self._whole("POST", url, headers, timeout_s, body)

    async def _whole(self, method: str, url: str, headers: dict[str, str], timeout_s: float, body: Any = None) -> Reply:
        try:
            async with self.session.request(
                method, url, headers=headers, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                return Reply(response.status, await response.read())
        except TRANSPORT_ERRORS as exc:
            raise UpstreamError(exc) from None
