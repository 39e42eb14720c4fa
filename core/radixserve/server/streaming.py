"""Request lifetime helpers shared by the OpenAI and native APIs: running the
TokenizerManager's generators, turning runtime exceptions into API errors
before a response starts, aborting on client disconnect, and SSE framing.

Every generator here closes the generators it reads from however it ends, and
``EventStreamResponse`` closes its body however the stream ends (a client gone
mid-send included): a request's runtime work is aborted as soon as nobody
waits for it, never later when the garbage collector gets to it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Iterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from radixserve.server.errors import APIError, bad_request, error_body
from radixserve.server.tokenizer_manager import (
    GenerateInput,
    PreparedInput,
    QueueFullError,
    RequestFailedError,
    RuntimeDeadError,
    TokenizerManager,
    merge_streams,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
Tagged = tuple[int, dict[str, Any]]  # (prompt index, result dict of the TokenizerManager)


@contextlib.contextmanager
def runtime_errors(renames: dict[str, str] | None = None) -> Iterator[None]:
    """Map the runtime's exceptions to API errors (used before a response starts)."""
    try:
        yield
    except ValueError as exc:
        raise bad_request(exc, renames) from exc
    except QueueFullError as exc:
        raise APIError(503, str(exc), code="queue_full") from exc
    except RuntimeDeadError as exc:
        raise APIError(503, str(exc)) from exc  # the reason: a dead runtime, or a shutdown
    except RequestFailedError as exc:
        raise APIError(exc.status, f"the request failed in the runtime: {exc}") from exc


def start_generation(
    tm: TokenizerManager, inputs: list[GenerateInput], renames: dict[str, str] | None = None
) -> AsyncGenerator[Tagged, None]:
    """Validate every prompt up front (a 400 before anything runs), then run
    them all, yielding ``(prompt index, result)`` as results arrive."""
    with runtime_errors(renames):
        prepared = [tm.prepare(inp) for inp in inputs]

    async def tagged(i: int, inp: PreparedInput) -> AsyncGenerator[Tagged, None]:
        async with contextlib.aclosing(tm.generate(inp)) as results:
            async for out in results:
                yield i, out

    streams = [tagged(i, inp) for i, inp in enumerate(prepared)]
    return streams[0] if len(streams) == 1 else merge_streams(streams)


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client goes away (which aborts its
    requests in the runtime and frees their KV)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done():
            raise APIError(499, "the client closed the connection") from None
        raise
    finally:
        watcher.cancel()


def raise_if_rejected(out: dict[str, Any], renames: dict[str, str] | None = None) -> None:
    """The scheduler refuses a prompt it cannot hold (e.g. larger than the KV
    pool) by aborting it at once with a message that names the field: a 400."""
    meta = out["meta_info"]
    reason = meta["finish_reason"]
    if reason and reason.type == "abort" and meta["completion_tokens"] == 0 and reason.message:
        error = bad_request(ValueError(reason.message), renames)
        if error.param is not None:
            raise error


async def collect(results: AsyncGenerator[Tagged, None], renames: dict[str, str] | None = None) -> list[Tagged]:
    async with contextlib.aclosing(results):
        items = [item async for item in results]
    for _, out in items:
        raise_if_rejected(out, renames)
    return items


async def first_and_rest(
    results: AsyncGenerator[Tagged, None], request: Request, renames: dict[str, str] | None = None
) -> AsyncGenerator[Tagged, None]:
    """Wait for the first result before a stream's headers go out, so that a
    full queue, a dead runtime or a rejected prompt still get their status.
    Returns an iterator over all results, the first included."""
    with runtime_errors(renames):
        first = await cancel_on_disconnect(request, results.__anext__())
    try:
        raise_if_rejected(first[1], renames)
    except APIError:
        await results.aclose()
        raise

    async def chained() -> AsyncGenerator[Tagged, None]:
        try:
            yield first
            async for item in results:
                yield item
        finally:
            await results.aclose()

    return chained()


# JSON leaves these unescaped, but ``str.splitlines`` (behind httpx's
# ``aiter_lines`` and requests' ``iter_lines``) breaks a line at each of them:
# a model that generates one would cut its event in two for those clients.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: Any) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body.translate(_LINE_BREAKS_JSON_KEEPS)}\n\n"


async def sse_stream(events: AsyncGenerator[Any, None]) -> AsyncGenerator[str, None]:
    """Frame events as server-sent events ending with ``data: [DONE]``. An error
    after the stream started can only be reported in band, as an error event."""
    try:
        with runtime_errors():  # the same mapping as before the stream started
            async with contextlib.aclosing(events):
                async for event in events:
                    yield sse(event)
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    except Exception as exc:  # a bug: log it, tell the client, end the stream
        logger.exception("error while streaming")
        yield sse(error_body(500, f"internal server error: {type(exc).__name__}: {exc}"))
    yield "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """``sse_stream(events)`` as a response that closes the stream when the
    response ends in any way, so that a client gone mid-send aborts its
    requests at once."""

    def __init__(self, events: AsyncGenerator[Any, None]) -> None:
        self._stream = sse_stream(events)
        super().__init__(self._stream, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.aclose()
