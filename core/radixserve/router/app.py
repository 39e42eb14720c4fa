"""``radixserve router``: one OpenAI-compatible endpoint in front of a fleet of workers.

    inference: POST /v1/chat/completions, /v1/completions, /generate, /v1/embeddings, /tokenize, /detokenize
    models:    GET /v1/models, /v1/models/{id} (the fleet's models, one entry per name, and the LoRA
               adapters its workers hold, each with its model as ``parent``)
    probes:    GET /health (503 with no healthy worker), /liveness, /metrics, /get_loads
    admin:     GET/POST /workers, DELETE /workers/{url}, POST /flush_cache,
               GET /debug/decisions (the last placements with every candidate's score terms)

Its state (prefix trees, loads, breakers, health) is soft: rebuilt from traffic and
probes, so several routers can stand side by side behind a plain load balancer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.router.admission import Admission
from radixserve.router.args import RouterArgs
from radixserve.router.fleet import Fleet
from radixserve.router.forwarder import Forwarder
from radixserve.router.latency import DecisionLog
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policies import PairPolicies, make_policy
from radixserve.router.request_info import TokenEstimator
from radixserve.router.upstream import Upstream, UpstreamError
from radixserve.server.errors import APIError, error_response, install_error_handlers
from radixserve.server.listen import base_url, bind_socket
from radixserve.server.middleware import RequestGuard

logger = logging.getLogger("radixserve.router")

# Path -> route name (the name in metrics; the ones read_request reads are routed by their text).
INFERENCE_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/generate": "generate",
    "/v1/embeddings": "embeddings",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
# Routes a user key opens; the rest need the admin key (or the user key when no admin key is set).
ADMIN_PATHS = frozenset({"/workers", "/flush_cache", "/debug/decisions"})
# The time registration at start-up may take before the router serves (pending workers join later).
STARTUP_REGISTRATION_S = 10.0


class AddWorkerBody(BaseModel):
    url: str


def create_router_app(args: RouterArgs, on_ready: Callable[[], None] = lambda: None) -> ASGIApp:
    """``on_ready`` runs once the workers named at start-up have joined (or stayed pending
    for ``STARTUP_REGISTRATION_S``)."""
    metrics = RouterMetrics()
    decisions = DecisionLog(args.decision_log_size)
    policy = make_policy(args, decisions=decisions)
    estimator = TokenEstimator()
    admission = Admission(
        args.max_concurrent_requests,
        args.rate_limit_tokens_per_second,
        args.queue_size,
        args.queue_timeout_secs,
        metrics,
    )
    upstream = Upstream(args.request_timeout_secs)
    pair = PairPolicies.of(args) if args.pd_disaggregation else None
    fleet = Fleet(args, upstream, [policy, *((pair.prefill, pair.decode) if pair else ())], metrics)
    forwarder = Forwarder(args, upstream, fleet, policy, admission, metrics, estimator, pair)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await upstream.start()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(fleet.add(url) for url in args.worker_urls), return_exceptions=True),
                STARTUP_REGISTRATION_S,
            )
        loops = [asyncio.create_task(fleet.run_health_checks()), asyncio.create_task(fleet.run_load_reads())]
        on_ready()
        try:
            yield
        finally:
            for task in loops:
                task.cancel()
            await upstream.close()

    app = FastAPI(title="radixserve router", lifespan=lifespan)
    install_error_handlers(app)

    # ---- models ----------------------------------------------------------------------
    def card(model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "radixserve"}

    def cards() -> dict[str, dict[str, Any]]:
        """The fleet's models, then the adapters its workers hold (a name taken by a model stays the model's)."""
        models = {model: card(model) for model in sorted(fleet.models())}
        adapters = {
            name: {**card(name), "root": adapter.path, "parent": adapter.model}
            for name, adapter in sorted(fleet.held_adapters().items())
            if name not in models
        }
        return models | adapters

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": list(cards().values())}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        found = cards().get(model_id)
        if found is None:
            raise APIError(404, f"model {model_id!r} is not served here", param="model", code="model_not_found")
        return found

    # ---- probes ----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        healthy = sum(w.healthy for w in fleet.workers.values())
        if not healthy:
            return error_response(503, "no healthy worker", code="no_worker_available")
        return JSONResponse({"status": "ok", "healthy_workers": healthy, "workers": len(fleet.workers)})

    @app.get("/liveness")
    async def liveness() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_loads")
    async def get_loads() -> dict[str, Any]:
        return {"workers": [{"url": w.url, **w.describe()["load"]} for w in fleet.workers.values()]}

    # ---- admin -----------------------------------------------------------------------
    @app.get("/workers")
    async def list_workers() -> dict[str, Any]:
        return {
            "workers": [w.describe() for w in fleet.workers.values()],
            "pending": sorted(fleet.pending),
            "policy": args.policy,
        }

    @app.get("/debug/decisions")
    async def recent_decisions(limit: int = 20) -> dict[str, Any]:
        """The last ``limit`` placements, oldest first (``latency_aware`` keeps them; other policies none)."""
        if limit < 1:
            raise APIError(400, f"limit: must be >= 1, got {limit}", param="limit")
        return {"policy": args.policy, "decisions": decisions.last(limit)}

    @app.post("/workers")
    async def add_worker(body: AddWorkerBody) -> Response:
        try:
            worker = await fleet.add(body.url)
        except ValueError as exc:
            raise APIError(400, str(exc), param="url") from None
        if worker is None:
            return JSONResponse({"status": "pending", "url": body.url}, status_code=202)
        return JSONResponse({"status": "added", "worker": worker.describe()})

    @app.delete("/workers/{url:path}")
    async def remove_worker(url: str) -> dict[str, Any]:
        if not fleet.remove(url):
            raise APIError(404, f"no worker {url!r} in the fleet", param="url")
        return {"status": "removed", "url": url}

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        async def flush(url: str) -> tuple[str, int]:
            try:
                reply = await upstream.post(url + "/flush_cache", headers=fleet.admin_headers, timeout_s=30)
                return url, reply.status
            except UpstreamError:
                return url, 502

        results = await asyncio.gather(*(flush(url) for url in fleet.workers))
        return {"success": all(code == 200 for _, code in results), "workers": dict(results)}

    return RequestGuard(
        InferenceRoutes(app, forwarder),
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        admin_paths=ADMIN_PATHS,
        max_payload_size=args.max_payload_size,
    )


class InferenceRoutes:
    """The inference routes straight to the forwarder, every other request (and the
    lifespan) to the FastAPI app: the hot path skips FastAPI's routing and objects."""

    def __init__(self, app: ASGIApp, forwarder: Forwarder):
        self.app, self.forwarder = app, forwarder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = INFERENCE_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
        elif scope["method"] != "POST":
            await error_response(405, f"{scope['path']} takes POST, not {scope['method']}")(scope, receive, send)
        else:
            await self.forwarder(scope, receive, send, route)


class _RouterServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """As uvicorn's, but the signal is not re-raised at exit: a router that shut down
        as asked exits with code 0. A second SIGINT stops without waiting."""
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def run_router(args: RouterArgs) -> int:
    """Serve until SIGTERM/SIGINT (then the requests in flight get
    ``--shutdown-grace-period-secs`` to finish)."""
    sock = bind_socket(args.host, args.port)
    url = base_url(args.host, sock.getsockname()[1])
    app = create_router_app(args, on_ready=lambda: print(f"radixserve router ready at {url}", flush=True))
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=args.log_level,
        access_log=False,  # the forwarder's log line names the worker
        proxy_headers=False,  # the client's address is used nowhere: not worth reading per request
        timeout_graceful_shutdown=args.shutdown_grace_period_secs,  # type: ignore[arg-type]  # a float works
        timeout_keep_alive=args.keep_alive_timeout_secs,  # type: ignore[arg-type]  # a float works
        loop="auto",  # uvloop where it is installed
    )
    server = _RouterServer(config)
    workers = " ".join(args.worker_urls) or "none yet (POST /workers)"
    print(f"radixserve router listening at {url} (policy {args.policy}; workers: {workers})", flush=True)
    server.run(sockets=[sock])
    return 0
