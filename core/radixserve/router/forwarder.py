"""Forwarding one request: choose a worker (one holding the LoRA adapter it names, which
the router has the worker load when none does: ``lora.AdapterRouting``), send, retry
elsewhere on failure while the client has received nothing, then pass the answer through
(streamed as it comes).

- A try fails on a connection error, a broken answer, or a retryable status (408, 429,
  500, 502, 503, 504). The worker's circuit breaker counts the failure; the next try,
  after an exponential backoff with jitter, goes to a worker not tried yet when there is
  one. Once the first byte of an answer reaches the client there is no retry: a stream
  that breaks off ends with an error event.
- A client that disconnects (while its request waits for admission, for a worker or
  for the next chunk of a stream) closes the request to the worker, which aborts it
  there (the worker frees its KV memory).
- One access-log line per request names the worker, the tries and the latency.

The forwarder speaks ASGI itself rather than through FastAPI's routing, ``Request``
and ``Response`` objects: per request, that layer cost about as much CPU as the
routing decision and the HTTP client together (docs/benchmarks.md, "P15b: the
router's CPU per request").
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import aiohttp
from starlette.types import Receive, Scope, Send

from radixserve.router.admission import Admission
from radixserve.router.args import RouterArgs
from radixserve.router.fleet import Fleet
from radixserve.router.lora import AdapterRouting
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policies import Choice, PairPolicies, Policy
from radixserve.router.request_info import (
    RequestInfo,
    TokenEstimator,
    latency_objective,
    parse_body,
    read_request,
    usage_prompt_tokens,
)
from radixserve.router.upstream import TRANSPORT_ERRORS, Upstream, UpstreamError
from radixserve.router.worker import Work, Worker
from radixserve.server.errors import APIError, error_body, error_response

logger = logging.getLogger("radixserve.router.access")

CLIENT_CLOSED = 499  # the client left before the answer was complete (nginx's code)
# The routes a prefill/decode pair serves (the others go to any one worker).
PAIRED_ROUTES = frozenset({"chat", "completions", "generate"})
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Hop-by-hop and framing headers are the router's own business on each side.
_DROPPED_HEADERS = frozenset(
    {b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"content-encoding"}
)
# The client's headers a worker sees (with the fleet's own: its key).
_PASSED_REQUEST_HEADERS = frozenset({b"x-request-id", b"accept"})


class TryFailed(Exception):
    def __init__(
        self,
        worker: Worker,
        kind: str,
        detail: str,
        response: aiohttp.ClientResponse | None = None,
        body: bytes = b"",
    ):
        super().__init__(detail)
        self.worker, self.kind, self.detail, self.response, self.body = worker, kind, detail, response, body


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


@dataclass(frozen=True)
class Outgoing:
    """What every try of one request sends: method, path and query, headers, and what
    routing read of it; ``trip`` records the tries."""

    method: str
    target: str
    headers: dict[str, str]
    info: RequestInfo
    trip: Trip


@dataclass
class Trip:
    """One request's way through the router: for its log line and metrics, and what
    the client has been sent so far."""

    method: str
    path: str
    started: float = field(default_factory=time.perf_counter)
    tries: list[str] = field(default_factory=list)
    status: int = 0
    responded: bool = False  # the answer's head has gone to the client
    finishing: bool = False  # its last message is going: a disconnect now is the answer's end
    client_left: bool = False

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
        pair: PairPolicies | None = None,
    ):
        """``pair``: with ``--pd-disaggregation``, the policies that choose each request's
        prefill and decode workers."""
        self.args, self.upstream, self.fleet, self.policy = args, upstream, fleet, policy
        self.admission, self.metrics, self.estimator, self.pair = admission, metrics, estimator, pair
        self.adapters = AdapterRouting(fleet, upstream, metrics)
        self.rng = random.Random()

    async def __call__(self, scope: Scope, receive: Receive, send: Send, route: str) -> None:
        """Serve one request of ``route`` (a name of ``app.INFERENCE_ROUTES``): read it,
        admit it, route it with retries, pass the answer on (streamed when it streams)."""
        trip = Trip(scope["method"], scope["path"])
        try:
            body = await _read_body(receive)
            payload = parse_body(body)
            info = read_request(route, payload, self.estimator, latency_objective(scope["headers"]))
        except APIError as exc:
            await error_response(exc.status, exc.message, exc.param, exc.code)(scope, receive, send)
            return
        handler = asyncio.current_task()
        assert handler is not None
        watcher = asyncio.get_running_loop().create_task(_watch_client(receive, handler, trip))
        admitted = False
        try:
            await self.admission.acquire()
            admitted = True
            query = scope.get("query_string", b"")
            target = scope["path"] + ("?" + query.decode("latin-1") if query else "")
            outgoing = Outgoing(scope["method"], target, self._headers(scope), info, trip)
            once = (
                partial(self._send_to_pair, outgoing, payload)
                if self.pair is not None and route in PAIRED_ROUTES
                else partial(self._send_to_one, outgoing, body)
            )
            answer = await self._send_with_retries(once)
            await self._pass_on(send, route, answer, info, trip)
        except asyncio.CancelledError:
            if not trip.client_left:
                raise
            trip.status = CLIENT_CLOSED
        except APIError as exc:
            trip.status = exc.status
            if not trip.responded:
                await error_response(exc.status, exc.message, exc.param, exc.code)(scope, receive, send)
        except Exception as exc:
            trip.status = 500
            logger.exception("internal error serving %s %s", trip.method, trip.path)
            if not trip.responded:
                message = f"internal server error: {type(exc).__name__}: {exc}"
                await error_response(500, message)(scope, receive, send)
        finally:
            watcher.cancel()
            if admitted:
                self.admission.release()
            self._log(trip, info)

    # ---- sending -------------------------------------------------------------------------
    async def _send_with_retries(self, once: Callable[[set[str]], Awaitable[Answer]]) -> Answer:
        """``once(tried)`` until it answers: after a failed try, backoff and again, to
        workers not tried yet where there are some."""
        tried: set[str] = set()
        backoff = self.args.retry_initial_backoff_ms / 1000
        for attempt in range(self.args.retry_max_retries + 1):
            try:
                return await once(tried)
            except TryFailed as failure:
                worker = failure.worker
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

    async def _choose(self, policy: Policy, info: RequestInfo, tried: set[str], role: str | None = None) -> Choice:
        """The worker ``policy`` chooses for the request among the candidates (of ``role``,
        when given), holding the LoRA adapter the request names once this returns where it can."""
        target = self.adapters.target(info)
        candidates = self.fleet.candidates(target.model, info.needs, tried, role)
        routing = self.adapters.routing(info.routing, target.adapter)
        choice = policy.choose(routing, self.adapters.place(candidates, target.adapter))
        await self.adapters.prepare(choice.worker, target.adapter)
        return choice

    async def _send_to_one(self, outgoing: Outgoing, body: bytes, tried: set[str]) -> Answer:
        info = outgoing.info
        choice = await self._choose(self.policy, info, tried)
        tried.add(choice.worker.url)
        outgoing.trip.tries.append(choice.worker.url)
        return await self._try(
            choice.worker, outgoing.method, outgoing.target, body, outgoing.headers, info, choice.work(info.routing)
        )

    async def _send_to_pair(self, outgoing: Outgoing, payload: dict[str, Any], tried: set[str]) -> Answer:
        """One try of a prefill/decode pair: the request goes to both with the same
        bootstrap fields; the decode worker's answer is the client's. A failure of either
        before that answer begins ends the other's request too (it aborts there, freeing
        its KV) and fails the try, so that another pair is tried."""
        assert self.pair is not None
        info = outgoing.info
        prefill = await self._choose(self.pair.prefill, info, tried, "prefill")
        decode = await self._choose(self.pair.decode, info, tried, "decode")
        host, port = self.fleet.bootstrap_of(prefill.worker)
        tried |= {prefill.worker.url, decode.worker.url}
        outgoing.trip.tries.append(decode.worker.url)
        fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": self.rng.getrandbits(62)}
        to_decode = json.dumps({**payload, **fields}).encode()
        whole = {k: v for k, v in payload.items() if k != "stream_options"}  # the prefill side's answer is read whole
        to_prefill = json.dumps({**whole, **fields, "stream": False}).encode()
        prefill_work = Work(prefill.work(info.routing).prompt, 1)
        prefilling = asyncio.ensure_future(
            self._try(
                prefill.worker,
                outgoing.method,
                outgoing.target,
                to_prefill,
                outgoing.headers,
                replace(info, stream=False),
                prefill_work,
            )
        )
        decoding = asyncio.ensure_future(
            self._try(
                decode.worker,
                outgoing.method,
                outgoing.target,
                to_decode,
                outgoing.headers,
                info,
                Work(0, info.routing.max_tokens),
                # The decode worker's 502 says its KV never came: the prefill side failed.
                blame_502=prefill.worker,
            )
        )
        try:
            await asyncio.wait({prefilling, decoding}, return_when=asyncio.FIRST_COMPLETED)
            if prefilling.done() and prefilling.exception() is not None:
                await prefilling  # raises its TryFailed
            answer = await decoding
        except BaseException:
            for task in (prefilling, decoding):
                task.cancel()
            await asyncio.gather(prefilling, decoding, return_exceptions=True)
            raise
        prefilling.add_done_callback(_prefill_ended)
        return answer

    async def _try(
        self,
        worker: Worker,
        method: str,
        target: str,
        body: bytes,
        headers: dict[str, str],
        info: RequestInfo,
        work: Work,
        blame_502: Worker | None = None,
    ) -> Answer:
        """Send to ``worker`` and read up to the first chunk of the answer (the whole answer
        when it does not stream): a failure up to there is a TryFailed, and can be retried.
        The worker's in-flight count holds the request until its answer is read whole (a
        stream: until the relay ends), with its ``work``. A failure counts against the
        worker's circuit breaker, but a 502 against ``blame_502``'s where given (a decode
        worker reports so the KV its prefill worker never sent)."""
        worker.breaker.on_send()
        self._hold(worker, work, +1)
        upstream: aiohttp.ClientResponse | None = None
        try:
            upstream = await self.upstream.open(method, worker.url + target, body, headers)
            if upstream.status in RETRYABLE_STATUSES:
                content = await upstream.read()
                upstream.release()
                # A decode worker's 502 in a pair: the KV never came, so its prefill worker failed.
                if upstream.status == 502 and blame_502 is not None:
                    self._hold(worker, work, -1)
                    worker.breaker.on_undecided()
                    self._count_failure(blame_502)
                else:
                    self._failed(worker, work)
                raise TryFailed(worker, "status", f"answered {upstream.status}", upstream, content)
            if not info.stream or not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                content = await upstream.read()
                upstream.release()
                worker.breaker.on_success()
                self._hold(worker, work, -1)
                return Answer(worker, upstream, content)
            chunks = upstream.content.iter_any()
            first = await chunks.__anext__()
        except TryFailed:  # counted where it was raised
            raise
        except (UpstreamError, *TRANSPORT_ERRORS, StopAsyncIteration) as exc:
            if upstream is not None:
                upstream.close()
            self._failed(worker, work)
            raise TryFailed(worker, "connect", f"{type(exc).__name__}: {exc}") from None
        except BaseException:  # cancelled: the client left
            if upstream is not None:
                upstream.close()  # the connection dropped: the worker aborts the request
            self._hold(worker, work, -1)
            worker.breaker.on_undecided()
            raise
        worker.breaker.on_success()
        return Answer(worker, upstream, first, chunks, held=work)

    def _failed(self, worker: Worker, work: Work) -> None:
        self._hold(worker, work, -1)
        self._count_failure(worker)

    def _count_failure(self, worker: Worker) -> None:
        worker.breaker.on_failure()
        self.metrics.worker_state(worker)

    def _hold(self, worker: Worker, work: Work, sign: int) -> None:
        worker.hold(work, sign)
        self.metrics.of(worker.url).in_flight.set(worker.in_flight)

    def _headers(self, scope: Scope) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        for name, value in scope["headers"]:
            if name == b"content-type" or name in _PASSED_REQUEST_HEADERS:
                headers[name.decode("latin-1")] = value.decode("latin-1")
        headers.update(self.fleet.headers)
        return headers

    # ---- answering ---------------------------------------------------------------------
    async def _pass_on(self, send: Send, route: str, answer: Answer, info: RequestInfo, trip: Trip) -> None:
        """Send the answer to the client: whole, or relayed chunk by chunk as it streams."""
        worker, upstream = answer.worker, answer.upstream
        trip.status = upstream.status
        headers = _passed_headers(upstream)
        if not answer.streaming:
            self._learn(info, answer.content)
            headers.append((b"content-length", str(len(answer.content)).encode()))
            trip.responded = trip.finishing = True
            await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
            await send({"type": "http.response.body", "body": answer.content})
            self._done(route, worker, trip, info)
            return
        self.metrics.of(worker.url).first_byte.observe(time.perf_counter() - trip.started)
        whole = False  # the stream came whole: its connection can serve again
        try:
            trip.responded = True
            await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
            await send({"type": "http.response.body", "body": answer.content, "more_body": True})
            assert answer.rest is not None
            try:
                async for chunk in answer.rest:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                whole = True
            except TRANSPORT_ERRORS as exc:
                self.metrics.errors.labels(worker.url, "stream").inc()
                trip.status = 502
                logger.warning("worker %s broke off a stream: %s", worker.url, exc)
                event = json.dumps(error_body(502, f"the worker broke off the stream: {exc}"))
                await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(), "more_body": True})
            trip.finishing = True
            await send({"type": "http.response.body", "body": b""})
        finally:
            self._hold(worker, answer.held, -1)
            if whole:
                upstream.release()
            else:  # broken, or the client left: the connection dropped (the worker aborts the request)
                upstream.close()
            if trip.client_left:
                trip.status = CLIENT_CLOSED
            self._done(route, worker, trip, info)

    def _learn(self, info: RequestInfo, content: bytes) -> None:
        prompt_tokens = usage_prompt_tokens(content)
        if prompt_tokens is not None:
            self.estimator.learn(info.routing.text, prompt_tokens)

    def _done(self, route: str, worker: Worker, trip: Trip, info: RequestInfo) -> None:
        series = self.metrics.of(worker.url)
        series.answered(route, trip.status).inc()
        series.latency.observe(time.perf_counter() - trip.started)
        series.routed_tokens.inc(info.routing.prompt_tokens)
        worker.routed += 1

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


def _prefill_ended(task: asyncio.Future[Answer]) -> None:
    """The prefill side's answer, once the decode side's is the client's: only logged
    when it failed (its KV had reached the decode worker, or that one would have failed)."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("the prefill side of a pair failed after its decode side answered: %s", task.exception())


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client left: what came is refused as incomplete JSON
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _watch_client(receive: Receive, handler: asyncio.Task[None], trip: Trip) -> None:
    """Cancel ``handler`` when the client disconnects before its answer is complete
    (the receive channel says ``http.disconnect`` at either)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if not trip.finishing:
        trip.client_left = True
        handler.cancel()


def _passed_headers(upstream: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in upstream.raw_headers if k.lower() not in _DROPPED_HEADERS]
