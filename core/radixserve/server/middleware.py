"""Checks that run before routing, as plain ASGI middleware: the HTTP version,
the bearer tokens (``--api-key``, ``--admin-api-key``) and the request body
limit (``--max-payload-size``).

Who gets in: ``OPEN_PATHS`` always; the admin paths (``ADMIN_PATHS`` for the
server, the router's own for ``radixserve router``) with the admin key when one
is set, else as the other routes; the other routes with the API key or the
admin key when an API key is set, else anyone."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.errors import error_response

# Probes and scrapers get in without the key.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/liveness", "/metrics"})
# What changes the server's state or writes files on its machine.
ADMIN_PATHS = frozenset(
    {
        "/flush_cache",
        "/abort_request",
        "/start_profile",
        "/stop_profile",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)
HTTP_VERSIONS = frozenset({"1.0", "1.1"})


def _bearer(key: str | None) -> bytes | None:
    return f"Bearer {key}".encode() if key else None


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        admin_api_key: str | None,
        max_payload_size: int,
        admin_paths: frozenset[str] = ADMIN_PATHS,
    ):
        self.app, self.admin_paths = app, admin_paths
        self.admin_prefixes = tuple(path + "/" for path in admin_paths)  # /workers/{url}
        user, admin = _bearer(api_key), _bearer(admin_api_key)
        # The Authorization headers that open each kind of route; empty: open to all.
        self.user_keys = [k for k in (user, admin) if k is not None] if user is not None else []
        self.admin_keys = [admin] if admin is not None else self.user_keys
        self.has_admin_key = admin is not None
        self.max_payload_size = max_payload_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["http_version"] not in HTTP_VERSIONS:  # e.g. an HTTP/2 preface ("PRI *"), a gRPC probe
            version = scope["http_version"]
            await error_response(
                505, f"HTTP/{version} is not served; this server speaks HTTP/1.1", code="http_version_not_supported"
            )(scope, receive, send)
            return
        path = scope["path"]
        admin = path in self.admin_paths or path.startswith(self.admin_prefixes)
        keys = [] if path in OPEN_PATHS else self.admin_keys if admin else self.user_keys
        if keys and not self._authorized(scope, keys):
            which = "the admin API key (--admin-api-key)" if admin and self.has_admin_key else "the API key"
            await error_response(
                401,
                f"invalid or missing key: this route needs {which}; send 'Authorization: Bearer <key>'",
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

    @staticmethod
    def _authorized(scope: Scope, keys: list[bytes]) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        return any(hmac.compare_digest(given, key) for key in keys)

    async def _read_body(self, scope: Scope, receive: Receive) -> list[Message] | None:
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
