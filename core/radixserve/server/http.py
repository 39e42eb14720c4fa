"""The HTTP server: FastAPI on uvicorn, hosting the TokenizerManager.

    OpenAI:  POST /v1/chat/completions, /v1/completions, /v1/embeddings (an embedding model), GET /v1/models[/{id}]
    native:  POST /generate, /tokenize, /detokenize, /flush_cache, /abort_request, /start_profile, /stop_profile,
             /load_lora_adapter, /unload_lora_adapter (and vLLM's /v1/... spellings)
             GET /health, /health_generate, /server_info, /model_info, /get_load, /v1/loads, /metrics
             (and /get_server_info, /get_model_info: SGLang's older names)

No ``/version``: SGLang's model gateway (smg 1.x) takes a worker that answers it for
vLLM and then looks for vLLM's metrics to learn its load; the version is in
``/server_info``.

The admin routes (flush, abort, profile, LoRA adapters) take ``--admin-api-key`` when one is
set (``middleware.RequestGuard``); ``/start_profile`` writes under ``--profile-dir``.

``run_server`` serves on the socket the CLI bound (``--port 0`` picks a free
port), prints ``radixserve listening at URL`` at once and ``radixserve ready at
URL`` when the runtime answers; it returns the process exit code (1 when the
runtime died or failed to start, 0 after a shutdown by SIGTERM or SIGINT).

Shutdown: the first SIGTERM/SIGINT drains the server (``ServerState.drain``:
new requests get 503, in-flight ones have ``--shutdown-timeout`` seconds, then
end with an error) before uvicorn closes any connection; a second one ends the
process at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any, cast

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from radixserve.config import ServerArgs
from radixserve.messages import ProfileOptions
from radixserve.runtime.processes.spawn import SpawnedRuntime
from radixserve.server import native_serving
from radixserve.server.access_log import AccessLog
from radixserve.server.embeddings import create_embeddings
from radixserve.server.errors import APIError, bad_request, error_body, error_response, install_error_handlers
from radixserve.server.listen import base_url
from radixserve.server.middleware import RequestGuard
from radixserve.server.protocol import (
    AbortRequestBody,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    GenerateRequestBody,
    LoadLoRAAdapterBody,
    StartProfileBody,
    TokenizeRequest,
    UnloadLoRAAdapterBody,
)
from radixserve.server.response_models import (
    ChatCompletionResponse,
    CompletionResponse,
    EmbeddingResponse,
    ModelCard,
    ModelList,
)
from radixserve.server.state import HEALTH_GENERATE_TIMEOUT_S, ServerState
from radixserve.server.worker_info import LOAD_SECTIONS, load_entries, scheduler_loads

logger = logging.getLogger(__name__)

# After the drain, how long uvicorn waits for the last responses to be written.
GRACEFUL_SHUTDOWN_S = 5
# How long a connection refused for a malformed request keeps reading (and
# dropping) what its client still sends, so the client reads the error instead
# of a reset connection.
LINGER_S = 2.0


def create_app(args: ServerArgs, request_exit: Callable[[int], None], started: SpawnedRuntime | None = None) -> FastAPI:
    state = ServerState(args, request_exit, started)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        boot = asyncio.create_task(state.start())
        try:
            yield
        finally:
            boot.cancel()
            await state.stop()

    app = FastAPI(title="radixserve", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(
        RequestGuard, api_key=args.api_key, admin_api_key=args.admin_api_key, max_payload_size=args.max_payload_size
    )
    app.add_middleware(HeaderLimit, max_header_size=args.max_header_size)
    app.add_middleware(AccessLog, metrics=state.metrics, log_bodies=args.log_requests)  # outermost: sees all
    install_error_handlers(app)

    # ---- OpenAI ----------------------------------------------------------------------
    # response_model=None: a stream is a StreamingResponse, which FastAPI cannot take for a model.
    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> ChatCompletionResponse | StreamingResponse:
        return await state.ready_openai().chat(body, request)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> CompletionResponse | StreamingResponse:
        return await state.ready_openai().completions(body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        return await create_embeddings(state.ready_openai(), body, request)

    def model_card() -> ModelCard:
        return ModelCard(
            id=state.model_name,
            root=state.model_path or state.model_name,
            max_model_len=state.ready_tm().context_length,
        )

    def adapter_cards() -> list[ModelCard]:
        return state.ready_adapters().cards(state.model_name, state.ready_tm().context_length)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(), *adapter_cards()])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        adapter = state.ready_openai().check_model(model_id)
        return model_card() if adapter is None else next(c for c in adapter_cards() if c.id == adapter)

    # ---- native ----------------------------------------------------------------------
    @app.post("/generate", response_model=None)
    async def generate(
        body: GenerateRequestBody, request: Request
    ) -> dict[str, Any] | list[dict[str, Any]] | StreamingResponse:
        return await native_serving.generate(state.ready_tm(), body, request, state.ready_adapters(), state.model_name)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        tm = state.ready_tm()
        state.ready_openai().check_model(body.model)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        tokens = [tm.tokenizer.encode(p, add_special_tokens=body.add_special_tokens) for p in prompts]
        if isinstance(body.prompt, str):
            return {"tokens": tokens[0], "count": len(tokens[0]), "max_model_len": tm.context_length}
        return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": tm.context_length}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        tm = state.ready_tm()
        state.ready_openai().check_model(body.model)
        if any(not 0 <= t < tm.vocab_size for t in body.tokens):
            raise APIError(400, f"tokens: every id must be in [0, {tm.vocab_size})", param="tokens")
        return {"text": tm.tokenizer.decode(body.tokens, skip_special_tokens=body.skip_special_tokens)}

    @app.get("/health")
    async def health() -> Response:
        if not await state.healthy():
            return error_response(503, "the scheduler does not answer")
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        tm = state.ready_tm()
        try:
            out = await asyncio.wait_for(state.generate_one_token(tm), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError) as exc:
            return error_response(503, f"a one-token generation failed: {type(exc).__name__}: {exc}")
        return JSONResponse({"status": "ok", "output_ids": out["output_ids"]})

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return await state.server_info()

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return state.model_info()

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return load_entries(await state.ready_tm().control("server_info"))

    @app.get("/v1/loads")
    async def v1_loads(include: str = "core") -> dict[str, Any]:
        unknown = sorted(set(include.split(",")) - set(LOAD_SECTIONS))
        if unknown:
            raise APIError(400, f"include: unknown section(s) {unknown}; known: {list(LOAD_SECTIONS)}", param="include")
        return scheduler_loads(await state.ready_tm().control("server_info"))

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        if not await state.ready_tm().control("flush_cache"):
            raise APIError(400, "the cache cannot be flushed while requests are running")
        return {"success": True}

    # ---- LoRA adapters (SGLang's routes, and vLLM's /v1 spellings) -----------------------
    @app.post("/load_lora_adapter")
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterBody) -> dict[str, Any]:
        await state.ready_adapters().load(state.ready_tm(), body.lora_name, body.lora_path, state.model_name)
        return {"success": True, "loaded_adapters": dict(state.ready_adapters().paths)}

    @app.post("/unload_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterBody) -> dict[str, Any]:
        await state.ready_adapters().unload(state.ready_tm(), body.lora_name)
        return {"success": True, "loaded_adapters": dict(state.ready_adapters().paths)}

    @app.post("/start_profile")
    async def start_profile(body: StartProfileBody | None = None) -> dict[str, Any]:
        body = body or StartProfileBody()
        tm = state.ready_tm()
        try:
            options = ProfileOptions(body.output_dir, body.record_shapes, body.num_steps)
            output_dir = state.profile_dir.resolve(options.output_dir)
            path = await tm.start_profile(dataclasses.replace(options, output_dir=output_dir))
        except ValueError as exc:
            raise bad_request(exc) from None
        return {"success": True, "trace_path": path}

    @app.post("/stop_profile")
    async def stop_profile() -> dict[str, Any]:
        tm = state.ready_tm()
        try:
            path = await tm.stop_profile()
        except ValueError as exc:
            raise bad_request(exc) from None
        return {"success": True, "trace_path": path}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequestBody) -> dict[str, Any]:
        await state.ready_tm().abort(body.rid)
        return {"success": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.status == "ready":
            # A runtime that just died still leaves the histograms worth scraping.
            with contextlib.suppress(RuntimeError, asyncio.TimeoutError):
                state.metrics.update(await state.ready_tm().control("server_info", timeout=5))
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def header_too_large(limit: int) -> tuple[int, str, str]:
    return 431, f"the request headers exceed {limit} bytes (--max-header-size)", "header_too_large"


class HeaderLimit:
    """ASGI middleware: 431 for headers over ``--max-header-size``. h11 enforces
    the limit only while a request is incomplete (see ``_EnvelopeH11Protocol``);
    headers that arrive whole are measured here."""

    def __init__(self, app: ASGIApp, max_header_size: int):
        self.app, self.max_header_size = app, max_header_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > self.max_header_size:
            status, message, code = header_too_large(self.max_header_size)
            await error_response(status, message, code=code)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _EnvelopeH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request it cannot parse with an OpenAI
    envelope rather than plain text: 431 (RFC 6585's status for it; h11 hints it
    too) when the headers exceed ``--max-header-size``, 400 otherwise."""

    _lingering = False  # once answered: the rest of the request is dropped

    def data_received(self, data: bytes) -> None:
        if not self._lingering:
            super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        limit = cast(int, self.config.h11_max_incomplete_event_size)  # run_server sets it
        if len(self.conn.trailing_data[0]) > limit:
            status, message, code = header_too_large(limit)
        else:
            status, message, code = 400, "the request is not valid HTTP/1.1", "invalid_http"
        body = json.dumps(error_body(status, message, code=code)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self._linger()

    def _linger(self) -> None:
        """Close after the client stops sending (or LINGER_S): closing a socket with
        unread input resets the connection, and the client would lose the answer."""
        self._lingering = True  # the rest of the request is dropped
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


class _Server(uvicorn.Server):
    """uvicorn, with the first SIGTERM/SIGINT draining the server before uvicorn
    stops accepting and closes connections; a second signal ends the requests in
    flight at once (each still gets its error), a third stops without cleanup."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self.draining = False
        self.cut_short = False
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it at exit,
        # and the process would end by the signal instead of with exit code 0.
        loop = self.state.loop
        if loop is None:  # still booting: nothing to drain
            self.should_exit = True
            return
        if self.draining:
            # A second signal ends the requests in flight now (they still get their
            # error event or envelope), then shuts down as usual; a third stops at once.
            self.force_exit = self.force_exit or self.cut_short
            self.cut_short = True
            loop.call_soon_threadsafe(self.state.cut_drain_short)
            return
        self.draining = True
        logger.info(
            "%s: draining (up to %g s, --shutdown-timeout), then shutting down; send it again to end "
            "the requests in flight now",
            signal.Signals(sig).name,
            self.shutdown_timeout,
        )
        loop.call_soon_threadsafe(self._start_drain, loop)

    def _start_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        self._drain_task = loop.create_task(self._drain())  # referenced, so it is not collected

    async def _drain(self) -> None:
        try:
            await self.state.drain(self.shutdown_timeout)
        finally:
            self.should_exit = True


def run_server(args: ServerArgs, sock: socket.socket, started: SpawnedRuntime | None = None) -> int:
    """Serve on ``sock`` (``listen.bind_socket``'s) until stopped; the process exit
    code. ``started``: the runtime, if it was spawned already (else the boot does)."""
    exit_code = 0
    server: _Server

    def request_exit(code: int) -> None:
        nonlocal exit_code
        exit_code = code
        server.should_exit = True

    app = create_app(args, request_exit, started)
    url = base_url(args.host, sock.getsockname()[1])
    state: ServerState = app.state.server
    state.on_ready = lambda: print(f"radixserve ready at {url}", flush=True)
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=args.log_level,
        lifespan="on",
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=_EnvelopeH11Protocol,
        h11_max_incomplete_event_size=args.max_header_size,
        timeout_keep_alive=args.timeout_keep_alive,  # type: ignore[arg-type]  # a float works
    )
    server = _Server(config, state, args.shutdown_timeout)
    print(f"radixserve listening at {url} (starting up; /health answers 503 until ready)", flush=True)
    server.run(sockets=[sock])
    return exit_code
