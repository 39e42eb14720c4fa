"""The HTTP server: FastAPI on uvicorn, hosting the TokenizerManager.

    OpenAI:  POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}]
    native:  POST /generate, /tokenize, /detokenize, /flush_cache, /abort_request
             GET /health, /health_generate, /get_server_info, /get_model_info, /metrics

``run_server`` binds the socket itself (``--port 0`` picks a free port), prints
``radixserve listening at URL`` at once and ``radixserve ready at URL`` when the
runtime answers; it returns the process exit code (1 when the runtime died or
failed to start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.config import ServerArgs
from radixserve.logging_utils import configure_logging
from radixserve.server import native_serving
from radixserve.server.errors import APIError, error_response, install_error_handlers
from radixserve.server.middleware import RequestGuard
from radixserve.server.protocol import (
    AbortRequestBody,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequestBody,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from radixserve.server.state import HEALTH_GENERATE_TIMEOUT_S, ServerState

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


def create_app(args: ServerArgs, request_exit: Callable[[int], None]) -> FastAPI:
    state = ServerState(args, request_exit)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        boot = asyncio.create_task(state.start())
        try:
            yield
        finally:
            boot.cancel()
            await state.stop()

    app = FastAPI(title="radixserve", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(RequestGuard, api_key=args.api_key, max_payload_size=args.max_payload_size)
    install_error_handlers(app)

    # ---- OpenAI ----------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await state.ready_openai().chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await state.ready_openai().completions(body, request)

    def model_card() -> ModelCard:
        return ModelCard(id=state.model_name, root=state.model_path or state.model_name,
                         max_model_len=state.ready_tm().context_length)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        state.ready_openai().check_model(model_id)
        return model_card()

    # ---- native ----------------------------------------------------------------------
    @app.post("/generate")
    async def generate(body: GenerateRequestBody, request: Request):
        return await native_serving.generate(state.ready_tm(), body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        tm = state.ready_tm()
        state.ready_openai().check_model(body.model)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        tokens = [tm.tokenizer.encode(p, add_special_tokens=body.add_special_tokens) for p in prompts]
        if isinstance(body.prompt, str):
            return {"tokens": tokens[0], "count": len(tokens[0]), "max_model_len": tm.context_length}
        return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": tm.context_length}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
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
        state.ready_tm()
        try:
            out = await asyncio.wait_for(state.generate_one_token(), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError) as exc:
            return error_response(503, f"a one-token generation failed: {type(exc).__name__}: {exc}")
        return JSONResponse({"status": "ok", "output_ids": out["output_ids"]})

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        return await state.server_info()

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        tm = state.ready_tm()
        summary = state.runtime.summary
        return {
            "model_path": state.model_path,
            "served_model_name": state.model_name,
            "tokenizer_path": state.runtime.tokenizer_path,
            "is_generation": True,
            "architecture": summary["architecture"],
            "context_length": tm.context_length,
            "vocab_size": tm.vocab_size,
            "has_chat_template": state.openai.chat_template.available,
        }

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        if not await state.ready_tm().control("flush_cache"):
            raise APIError(400, "the cache cannot be flushed while requests are running")
        return {"success": True}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequestBody) -> dict:
        await state.ready_tm().abort(body.rid)
        return {"success": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.status == "ready":
            # A runtime that just died still leaves the histograms worth scraping.
            with contextlib.suppress(RuntimeError, asyncio.TimeoutError):
                state.metrics.update((await state.tm.control("server_info", timeout=5))["stats"])
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(args: ServerArgs) -> int:
    """Serve until stopped; the process exit code."""
    configure_logging(args.log_level, prefix="server")
    exit_code = 0
    server: uvicorn.Server

    def request_exit(code: int) -> None:
        nonlocal exit_code
        exit_code = code
        server.should_exit = True

    app = create_app(args, request_exit)
    sock = _bind(args.host, args.port)
    url = _url(args.host, sock.getsockname()[1])
    app.state.server.on_ready = lambda: print(f"radixserve ready at {url}", flush=True)
    config = uvicorn.Config(app, log_config=None, log_level=args.log_level, lifespan="on",
                            access_log=args.log_level == "debug", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = uvicorn.Server(config)
    print(f"radixserve listening at {url} (starting up; /health answers 503 until ready)", flush=True)
    server.run(sockets=[sock])
    return exit_code
