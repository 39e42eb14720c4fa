"""Checks that run before routing, as plain ASGI middleware: the bearer token
(``--api-key``) and the request body limit (``--max-payload-size``)."""

from __future__ import annotations

import hmac
from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.errors import error_response

# Probes and scrapers get in without the key.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: Optional[str], max_payload_size: int):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_payload_size = max_payload_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.expected is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            await error_response(
                401, "invalid or missing API key; send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )(scope, receive, send)
            return
        body = await self._read_body(scope, receive)
        if body is None:
            await error_response(
                413,
                f"the request body exceeds {self.max_payload_size} bytes (--max-payload-size)",
                code="payload_too_large",
            )(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)

    async def _read_body(self, scope: Scope, receive: Receive) -> Optional[list[Message]]:
        """The body's messages, or None when it is too large. Buffering it here
        means an oversized (even chunked) upload never reaches a route."""
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_payload_size:
            return None
        size, chunks = 0, []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return [message]  # the client left; let the app see it
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_payload_size:
                return None
            if not message.get("more_body", False):
                return [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that returns the buffered body, then the live channel
    (where the client's disconnect arrives)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
