"""Checks that run before routing, as plain ASGI middleware: the bearer tokens
(``--api-key``; ``--admin-api-key`` on the admin paths) and the request body limit
(``--max-payload-size``)."""

from __future__ import annotations

import hmac
from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.errors import error_response

# Probes and scrapers get in without the key.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/liveness", "/metrics"})


class RequestGuard:
    """``admin_paths`` (prefixes) need ``admin_api_key`` when it is set, else ``api_key``;
    the other paths but ``OPEN_PATHS`` need ``api_key`` when it is set."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: Optional[str],
        max_payload_size: int,
        admin_api_key: Optional[str] = None,
        admin_paths: tuple[str, ...] = (),
    ):
        self.app = app
        self.user_token = _bearer(api_key)
        self.admin_token = _bearer(admin_api_key) or self.user_token
        self.admin_paths = admin_paths
        self.max_payload_size = max_payload_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        admin = path.startswith(self.admin_paths) if self.admin_paths else False
        expected = None if path in OPEN_PATHS else self.admin_token if admin else self.user_token
        if expected is not None and not hmac.compare_digest(
            dict(scope["headers"]).get(b"authorization", b""), expected
        ):
            which = "the admin API key" if admin and self.admin_token != self.user_token else "the API key"
            await error_response(
                401,
                f"invalid or missing key: {path} needs {which}; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
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


def _bearer(key: Optional[str]) -> Optional[bytes]:
    return f"Bearer {key}".encode() if key else None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that returns the buffered body, then the live channel
    (where the client's disconnect arrives)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
