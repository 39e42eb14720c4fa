"""Forwarding one request: choose a worker, send, retry elsewhere on failure while the
client has received nothing, then pass the answer through (streamed as it comes).

- A try fails on a connection error, a broken answer, or a retryable status (408, 429,
  500, 502, 503, 504). The worker's circuit breaker counts the failure; the next try,
  after an exponential backoff with jitter, goes to a worker not tried yet when there is
  one. Once the first byte of an answer reaches the client there is no retry: a stream
  that breaks off ends with an error event.
- A client that disconnects closes the request to the worker, which aborts it there
  (the worker frees its KV memory).
- One access-log line per request names the worker, the tries and the latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from radixserve.router.admission import Admission
from radixserve.router.args import RouterArgs
from radixserve.router.fleet import Fleet
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policies import Policy
from radixserve.router.request_info import RequestInfo, TokenEstimator
from radixserve.router.upstream import TRANSPORT_ERRORS, Upstream, UpstreamError
from radixserve.router.worker import Work, Worker
from radixserve.server.errors import APIError, error_body

logger = logging.getLogger("radixserve.router.access")

CLIENT_CLOSED = 499  # the client left before the answer was complete (nginx's code)
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Hop-by-hop and framing headers are the router's own business on each side.
_DROPPED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"})


class TryFailed(Exception):
    def __init__(self, kind: str, detail: str, response: aiohttp.ClientResponse | None = None, body: bytes = b""):
        super().__init__(detail)
        self.kind, self.detail, self.response, self.body = kind, detail, response, body


@dataclass
class Answer:
    """A worker's answer, read up to its first chunk (``streaming``) or whole."""

    worker: Worker
    upstream: aiohttp.ClientResponse  # its head; the body is ``content`` and ``rest``
    content: bytes  # the whole answer, or its first chunk when it streams
    rest: AsyncIterator[bytes] | None = None  # the stream's other chunks
    held: Work = Work(0, 0)  # the work the stream holds on the worker until it ends

    @property
    def streaming(self) -> bool:
        return self.rest is not None


@dataclass
class Trip:
    """One request's way through the router, for its log line and metrics."""

    method: str
    path: str
    started: float = field(default_factory=time.perf_counter)
    tries: list[str] = field(default_factory=list)
    status: int = 0

    @property
    def worker(self) -> str:
        return self.tries[-1] if self.tries else "-"


class Forwarder:
    def __init__(
        self,
        args: RouterArgs,
        upstream: Upstream,
        fleet: Fleet,
        policy: Policy,
        admission: Admission,
        metrics: RouterMetrics,
        estimator: TokenEstimator,
    ):
        self.args, self.upstream, self.fleet, self.policy = args, upstream, fleet, policy
        self.admission, self.metrics, self.estimator = admission, metrics, estimator
        self.rng = random.Random()

    async def forward(self, request: Request, route: str, body: bytes, info: RequestInfo) -> Response:
        """Admit, route, send with retries; the answer (streamed when it streams)."""
        trip = Trip(request.method, request.url.path)
        await self.admission.acquire()
        released = False
        try:
            answer = await self._unless_client_leaves(request, self._send_with_retries(request, body, info, trip))
            if answer is None:
                trip.status = CLIENT_CLOSED
                self._log(trip, info)
                return Response(status_code=CLIENT_CLOSED)
            if answer.streaming:
                released = True  # the stream's end releases the admission place
                return self._stream(route, answer, info, trip)
            return self._whole(route, answer, info, trip)
        except APIError as exc:
            trip.status = exc.status
            self._log(trip, info)
            raise
        finally:
            if not released:
                self.admission.release()

    @staticmethod
    async def _unless_client_leaves(request: Request, sending: Awaitable[Answer]) -> Answer | None:
        """The answer, or None when the client disconnects first (the try is cancelled,
        which closes its connection to the worker: the worker aborts the request)."""
        send = asyncio.ensure_future(sending)
        leave = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({send, leave}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (send, leave) if not send.done() else (leave,):
                task.cancel()
        if not send.done():
            with contextlib.suppress(asyncio.CancelledError):
                await send
            return None
        return send.result()

    # ---- sending -------------------------------------------------------------------------
    async def _send_with_retries(self, request: Request, body: bytes, info: RequestInfo, trip: Trip) -> Answer:
        tried: set[str] = set()
        backoff = self.args.retry_initial_backoff_ms / 1000
        for attempt in range(self.args.retry_max_retries + 1):
            choice = self.policy.choose(info.routing, self.fleet.candidates(info.model, info.needs, tried))
            worker = choice.worker
            tried.add(worker.url)
            trip.tries.append(worker.url)
            try:
                return await self._try(request, worker, body, info, choice.work(info.routing))
            except TryFailed as failure:
                self.metrics.errors.labels(worker.url, failure.kind).inc()
                last_try = attempt == self.args.retry_max_retries
                logger.warning(
                    "worker %s failed (%s: %s)%s",
                    worker.url,
                    failure.kind,
                    failure.detail,
                    "" if last_try else "; retrying",
                )
                if last_try:
                    if failure.response is not None:  # the worker's own answer, passed on
                        return Answer(worker, failure.response, failure.body)
                    raise APIError(
                        502, f"no worker answered: {worker.url}: {failure.detail}", code="bad_gateway"
                    ) from None
                self.metrics.retries.labels(worker.url).inc()
                jitter = 1 + self.args.retry_jitter_factor * (2 * self.rng.random() - 1)
                await asyncio.sleep(backoff * jitter)
                backoff = min(backoff * self.args.retry_backoff_multiplier, self.args.retry_max_backoff_ms / 1000)
        raise AssertionError("unreachable")

    async def _try(self, request: Request, worker: Worker, body: bytes, info: RequestInfo, work: Work) -> Answer:
        """Send to ``worker`` and read up to the first chunk of the answer (the whole answer
        when it does not stream): a failure up to there is a TryFailed, and can be retried.
        The worker's in-flight count holds the request until its answer is read whole (a
        stream: until the relay ends), with its ``work``."""
        worker.breaker.on_send()
        self._hold(worker, work, +1)
        upstream: aiohttp.ClientResponse | None = None
        try:
            target = worker.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
            upstream = await self.upstream.open(request.method, target, body, self._headers(request))
            if upstream.status in RETRYABLE_STATUSES:
                content = await upstream.read()
                upstream.release()
                raise TryFailed("status", f"answered {upstream.status}", upstream, content)
            if not info.stream or not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                content = await upstream.read()
                upstream.release()
                worker.breaker.on_success()
                self._hold(worker, work, -1)
                return Answer(worker, upstream, content)
            chunks = upstream.content.iter_any()
            first = await chunks.__anext__()
        except TryFailed:
            self._failed(worker, work)
            raise
        except (UpstreamError, *TRANSPORT_ERRORS, StopAsyncIteration) as exc:
            if upstream is not None:
                upstream.close()
            self._failed(worker, work)
            raise TryFailed("connect", f"{type(exc).__name__}: {exc}") from None
        except BaseException:  # cancelled: the client left
            if upstream is not None:
                upstream.close()  # the connection dropped: the worker aborts the request
            self._hold(worker, work, -1)
            raise
        worker.breaker.on_success()
        return Answer(worker, upstream, first, chunks, held=work)

    def _failed(self, worker: Worker, work: Work) -> None:
        self._hold(worker, work, -1)
        worker.breaker.on_failure()
        self.metrics.worker_state(worker)

    def _hold(self, worker: Worker, work: Work, sign: int) -> None:
        worker.hold(work, sign)
        self.metrics.in_flight.labels(worker.url).set(worker.in_flight)

    def _headers(self, request: Request) -> dict[str, str]:
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        for name in ("x-request-id", "accept"):
            if name in request.headers:
                headers[name] = request.headers[name]
        headers.update(self.fleet.headers)
        return headers

    # ---- answering ---------------------------------------------------------------------
    def _whole(self, route: str, answer: Answer, info: RequestInfo, trip: Trip) -> Response:
        worker, upstream = answer.worker, answer.upstream
        trip.status = upstream.status
        self._learn(info, answer.content)
        self._done(route, worker, trip, info)
        return Response(answer.content, status_code=upstream.status, headers=_passed_headers(upstream))

    def _stream(self, route: str, answer: Answer, info: RequestInfo, trip: Trip) -> StreamingResponse:
        worker, upstream, first, rest = answer.worker, answer.upstream, answer.content, answer.rest
        assert rest is not None
        trip.status = upstream.status
        self.metrics.first_byte.labels(worker.url).observe(time.perf_counter() - trip.started)

        async def relay() -> AsyncIterator[bytes]:
            ended = False  # by the worker; otherwise the client left (Starlette cancels the relay)
            whole = False  # the stream came whole: its connection can serve again
            try:
                yield first
                async for chunk in rest:
                    yield chunk
                ended = whole = True
            except TRANSPORT_ERRORS as exc:
                ended = True
                self.metrics.errors.labels(worker.url, "stream").inc()
                trip.status = 502
                logger.warning("worker %s broke off a stream: %s", worker.url, exc)
                yield (
                    b"data: "
                    + json.dumps(error_body(502, f"the worker broke off the stream: {exc}")).encode()
                    + b"\n\n"
                )
            finally:
                trip.status = trip.status if ended else CLIENT_CLOSED
                self._hold(worker, answer.held, -1)
                self.admission.release()
                self._done(route, worker, trip, info)
                if whole:
                    upstream.release()
                else:  # broken, or the client left: the connection dropped (the worker aborts the request)
                    upstream.close()

        return StreamingResponse(relay(), status_code=upstream.status, headers=_passed_headers(upstream))

    def _learn(self, info: RequestInfo, content: bytes) -> None:
        try:
            usage = json.loads(content).get("usage") or {}
        except (ValueError, AttributeError):
            return
        if isinstance(usage.get("prompt_tokens"), int):
            self.estimator.learn(info.routing.text, usage["prompt_tokens"])

    def _done(self, route: str, worker: Worker, trip: Trip, info: RequestInfo) -> None:
        self.metrics.requests.labels(worker.url, route, str(trip.status)).inc()
        self.metrics.latency.labels(worker.url).observe(time.perf_counter() - trip.started)
        self.metrics.routed_tokens.labels(worker.url).inc(info.routing.prompt_tokens)
        worker.routed += 1
        self._log(trip, info)

    def _log(self, trip: Trip, info: RequestInfo) -> None:
        logger.info(
            "%s %s %d worker=%s tries=%d latency=%.1fms prompt~%d",
            trip.method,
            trip.path,
            trip.status,
            trip.worker,
            len(trip.tries),
            (time.perf_counter() - trip.started) * 1000,
            info.routing.prompt_tokens,
        )


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _passed_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_HEADERS}
