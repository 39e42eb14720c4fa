"""The access log: one INFO line per HTTP request, written when its response
ends, as plain ASGI middleware (the outermost one, so refusals by the other
middleware are logged too):

    POST /v1/chat/completions 200 prompt=31 completion=16 latency=412.7ms id=chatcmpl-1f2e client=127.0.0.1:51234

``prompt``/``completion`` appear where the request generated: the
TokenizerManager adds each request's token counts to the ``RequestRecord`` it
finds in the ``current_request`` context variable, which this middleware sets
(child tasks, such as the ones running the n choices, see the same record).
Status 499 means the client went away before the response was complete.
With ``--log-requests`` the line also carries the finish reasons and the
request body (its first ``BODY_LOG_BYTES``). Probes and scrapes that succeed
log at DEBUG, so that they do not drown the traffic. Error statuses are also
counted in the ``num_request_errors_total`` metric.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.messages import TokenOutput
from radixserve.server.metrics import ServerMetrics

logger = logging.getLogger("radixserve.access")

BODY_LOG_BYTES = 2048
QUIET_PATHS = frozenset({"/health", "/health_generate", "/metrics", "/server_info", "/get_server_info", "/get_load"})
CLIENT_CLOSED = 499


@dataclass
class RequestRecord:
    """What one HTTP request generated: prompt tokens per client request id,
    completion tokens and finish reason per choice (scheduler request id)."""

    prompt_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: dict[str, int] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)

    def update(self, rid: str, internal: str, out: TokenOutput) -> None:
        self.prompt_tokens[rid] = out.prompt_tokens
        self.completion_tokens[internal] = out.completion_tokens
        if out.finish_reason is not None:
            self.finish_reasons[internal] = out.finish_reason.type


current_request: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "radixserve_current_request", default=None
)


class AccessLog:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics | None = None, log_bodies: bool = False):
        self.app = app
        self.metrics = metrics
        self.log_bodies = log_bodies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        record = RequestRecord()
        current_request.set(record)  # this task's context: the request's own
        status: int | None = None
        complete = disconnected = False
        body = bytearray()

        async def receive_logged() -> Message:
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
            elif self.log_bodies and len(body) < BODY_LOG_BYTES:
                body.extend(message.get("body", b"")[: BODY_LOG_BYTES - len(body)])
            return message

        async def send_logged(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive_logged, send_logged)
        except OSError:  # the connection broke while sending
            disconnected = True
            raise
        except BaseException:
            status = status or 500
            raise
        finally:
            final = CLIENT_CLOSED if disconnected and not complete else (status or 500)
            self._log(scope, final, record, time.perf_counter() - started, bytes(body))

    def _log(self, scope: Scope, status: int, record: RequestRecord, seconds: float, body: bytes) -> None:
        if status >= 400 and self.metrics is not None:
            self.metrics.record_error(status)
        path = scope["path"]
        level = logging.DEBUG if path in QUIET_PATHS and status < 400 else logging.INFO
        if not logger.isEnabledFor(level):
            return
        parts = [scope["method"], path, str(status)]
        if record.completion_tokens:
            parts.append(f"prompt={sum(record.prompt_tokens.values())}")
            parts.append(f"completion={sum(record.completion_tokens.values())}")
        parts.append(f"latency={seconds * 1000:.1f}ms")
        if record.prompt_tokens:
            rids = list(record.prompt_tokens)
            parts.append("id=" + ",".join(rids[:4]) + (f",+{len(rids) - 4}" if len(rids) > 4 else ""))
        client = scope.get("client")
        parts.append(f"client={client[0]}:{client[1]}" if client else "client=-")
        if self.log_bodies:
            if record.finish_reasons:
                parts.append("finish=" + ",".join(record.finish_reasons.values()))
            truncated = "..." if len(body) >= BODY_LOG_BYTES else ""
            parts.append(f"body={body.decode('utf-8', 'replace')!r}{truncated}")
        logger.log(level, " ".join(parts))
