"""The server's runtime, from boot to shutdown.

The HTTP server answers at once (``/health`` is 503 while starting); the boot
runs in the background: resolve the model (maybe building the demo model or
downloading) and launch the scheduler and detokenizer processes (unless the CLI
started them already, ``startup_checks.start_runtime``), wait for them, create the
TokenizerManager in the serving event loop with the scheduler's tokenizer, warm
up, and ask the scheduler for its health. If a runtime process dies later,
every waiting request fails and the server exits: a half-dead server must not
linger behind a load balancer. The exception is a data-parallel replica while
others live: the DP controller ends that replica's requests, reports it, and
the rest serve on.

A start-up failure is logged as one line (the traceback at debug level). On
SIGTERM the server drains (``drain``) before it stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from radixserve.checkpoints.demo import DEMO_MODEL_NAME
from radixserve.checkpoints.source import resolve_model_path, warn_demo_model
from radixserve.config import ServerArgs
from radixserve.registry import get_registry
from radixserve.runtime.processes.spawn import (
    RuntimeProcesses,
    SpawnedRuntime,
    plan_runtime,
    spawn_runtime,
    wait_until_ready,
)
from radixserve.server.chat_template import ChatTemplate
from radixserve.server.errors import APIError
from radixserve.server.lora import ServedAdapters
from radixserve.server.metrics import ServerMetrics
from radixserve.server.openai_serving import OpenAIServing
from radixserve.server.profile_dir import ProfileDir
from radixserve.server.tokenizer_manager import GenerateInput, TokenizerManager
from radixserve.server.worker_info import internal_states, worker_facts
from radixserve.startup_error import StartupError

logger = logging.getLogger(__name__)

T = TypeVar("T")

HEALTH_TIMEOUT_S = 10.0
HEALTH_GENERATE_TIMEOUT_S = 60.0
# After ending the requests left at the drain's deadline, how long to wait for
# their handlers to answer.
FAIL_GRACE_S = 5.0
DRAIN_POLL_S = 0.05
SHUTDOWN_REASON = "the server is shutting down"
# Flags that server_info shows as "<redacted>" when set.
SECRET_ARGS = ("api_key", "admin_api_key")


async def _in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking startup work off the event loop. A daemon thread, unlike
    ``asyncio.to_thread``, does not hold up the exit of a server stopped
    mid-boot (its child processes die with us)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():  # the awaiting coroutine may have been cancelled
            future.set_result(result) if error is None else future.set_exception(error)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting coroutine
            result, error = None, exc
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, daemon=True, name=f"boot-{fn.__name__}").start()
    return await future


class ServerState:
    def __init__(
        self, args: ServerArgs, request_exit: Callable[[int], None], started: SpawnedRuntime | None = None
    ) -> None:
        """``started``: the runtime, spawned already (``startup_checks.start_runtime``);
        else the boot resolves the model and spawns it."""
        self.args = args
        self.model_name = args.served_model_name or args.model_path or DEMO_MODEL_NAME
        self.metrics = ServerMetrics(self.model_name)
        self.request_exit = request_exit
        self.status = "starting"  # -> ready | failed | dead | draining
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, set by the app's lifespan
        self.model_path: str | None = started.runtime.model_path if started else None
        self.runtime: RuntimeProcesses | None = started.runtime if started else None
        self._ready_pipes: list[Connection] = started.ready if started else []
        self.tm: TokenizerManager | None = None
        self.openai: OpenAIServing | None = None
        self.adapters: ServedAdapters | None = None  # the LoRA adapters offered, set by the boot
        self.on_ready: Callable[[], None] = lambda: None
        self.profile_dir = ProfileDir(args.profile_dir)
        self._drain_cut_short = False

    # ---- boot and shutdown -----------------------------------------------------------
    async def start(self) -> None:
        try:
            await self._boot()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._report_startup_failure(exc)
            self.status = "failed"
            self.request_exit(1)
            return
        if self.status == "starting":  # not draining already
            self.status = "ready"
            self.on_ready()

    @staticmethod
    def _report_startup_failure(exc: Exception) -> None:
        if isinstance(exc, StartupError):
            logger.error("startup failed: %s", exc)
            if exc.hint:
                logger.error("hint: %s", exc.hint)
        else:
            logger.error("startup failed: %s: %s", type(exc).__name__, exc)
        logger.debug("startup failure", exc_info=exc)
        if logger.getEffectiveLevel() > logging.DEBUG:
            logger.error("(--log-level debug shows the traceback)")

    async def _boot(self) -> None:
        args = self.args
        if self.runtime is None:
            self.model_path = await _in_daemon_thread(resolve_model_path, args)
            # Spawned from this (the event loop's) thread, which lives as long as the server.
            self.runtime, self._ready_pipes = spawn_runtime(args, self.model_path)
        elif self.runtime.held:  # the demo model's first build; the held rank imports meanwhile
            self.model_path = await _in_daemon_thread(resolve_model_path, args)
            self.runtime.release(await _in_daemon_thread(plan_runtime, args, self.model_path))
        elif args.model_path is None:
            warn_demo_model(self.runtime.model_path)  # resolve_model_path's warning, for the runtime the CLI started
        await _in_daemon_thread(wait_until_ready, self.runtime, self._ready_pipes)
        loop = asyncio.get_running_loop()
        runtime = self.runtime

        def on_death(reason: str) -> None:
            loop.call_soon_threadsafe(self._on_runtime_death, reason)

        runtime.watch(on_death)
        tokenizer = runtime.tokenizer
        summary = runtime.summary
        self.tm = tm = TokenizerManager(args, tokenizer, runtime.endpoints, summary)
        tm.start()
        template = ChatTemplate(tokenizer, args.chat_template)
        tool_parser = get_registry().tool_parser(args.tool_call_parser, template.source)
        reasoning_parser = get_registry().reasoning_parser(args.reasoning_parser) if args.reasoning_parser else None
        self.adapters = ServedAdapters.of_summary(summary)
        self.openai = OpenAIServing(tm, self.model_name, template, self.adapters, tool_parser, reasoning_parser)
        self._log_summary(template, summary, tm)
        if not args.skip_server_warmup:
            await self.generate_one_token(tm)
        await tm.control("health", timeout=HEALTH_TIMEOUT_S)
        tm.metrics = self.metrics  # after the warm-up, which is not traffic

    def _log_summary(self, template: ChatTemplate, s: dict[str, Any], tm: TokenizerManager) -> None:
        args = self.args
        demo = " (the built-in demo model: RANDOM weights)" if args.model_path is None else ""
        logger.info(
            "model: %s%s, served as %r, architecture %s", self.model_path, demo, self.model_name, s["architecture"]
        )
        logger.info("device: %s (platform %s, --device %s)", s["device"], s["platform"], args.device)
        if s["tp_size"] > 1:
            logger.info(
                "tensor parallel: tp_size %d over %d node(s), %d rank(s) per node (rank 0's device above)",
                s["tp_size"],
                args.nnodes,
                args.ranks_per_node,
            )
        if args.dp_size > 1:
            logger.info(
                "data parallel: %d replicas behind the DP controller (%s); the figures below are each replica's",
                args.dp_size,
                args.load_balance_method,
            )
        for kind, name in s["backends"].items():
            how = s["backend_choices"].get(kind, "?")
            if kind == "quantization":  # never chosen automatically
                how = "--quantization" if args.quantization else "the checkpoint's" if name != "none" else "none asked"
            logger.info("%s backend: %s (%s)", kind, name, how)
        logger.info("dtype %s (%s), KV cache dtype %s", s["dtype"], s["dtype_reason"], s["kv_cache_dtype"])
        memory = s["memory"]
        logger.info(
            "KV pool %d tokens, %.1f GiB (page size %d); memory %.1f GiB total, %.1f GiB available, "
            "weights %.1f GiB; context length %d; max running requests %d",
            s["max_total_tokens"],
            memory["kv_pool_bytes"] / 2**30,
            s["page_size"],
            memory["total_bytes"] / 2**30,
            memory["available_bytes"] / 2**30,
            memory["weights_bytes"] / 2**30,
            s["context_length"],
            s["max_running_requests"],
        )
        graphs = s["graphs"]
        if graphs["backend"]:
            logger.info(
                "decode graphs: %s for batch sizes %s, captured in %.1f s",
                graphs["backend"],
                graphs["batch_sizes"],
                graphs["capture_seconds"],
            )
        else:
            logger.info("decode graphs: off (%s)", graphs["reason"])
        logger.info("chat template: %s", template.origin)
        embedding = tm.embedding
        if embedding is not None:
            logger.info(
                "served for embeddings (/v1/embeddings; it does not generate): %s pooling, %snormalised (%s)",
                embedding.pooling,
                "" if embedding.normalize else "not ",
                embedding.source,
            )

    def _on_runtime_death(self, reason: str) -> None:
        if self.status == "dead":
            return
        logger.error("a runtime process died (%s); shutting the server down", reason)
        self.status = "dead"
        if self.tm is not None:
            self.tm.fail_all(f"the runtime is down: {reason}")
        self.request_exit(1)

    async def drain(self, timeout: float) -> None:
        """Stop admitting (every route, /health included, answers 503), give the
        requests in flight up to ``timeout`` seconds, then end the rest: each
        gets an error (an error event and ``[DONE]`` on a stream, a 503 envelope
        otherwise), and this returns once their handlers have answered."""
        was_ready = self.status == "ready"
        if self.status in ("starting", "ready"):
            self.status = "draining"
        if not was_ready or self.tm is None:
            return
        tm = self.tm
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while tm.num_in_flight and loop.time() < deadline and not self._drain_cut_short:
            await asyncio.sleep(DRAIN_POLL_S)
        left = tm.num_in_flight
        if left:
            why = "a second signal" if self._drain_cut_short else f"shutdown timeout ({timeout:.0f} s) reached"
            logger.warning("%s: ending %d request(s) still running", why, left)
        else:
            logger.info("no request in flight; shutting down")
        # Also refuses any request that got past the door just before draining began.
        tm.fail_all(SHUTDOWN_REASON)
        deadline = loop.time() + FAIL_GRACE_S
        while tm.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    def cut_drain_short(self) -> None:
        """End the requests in flight now instead of at the shutdown timeout."""
        self._drain_cut_short = True

    async def stop(self) -> None:
        if self.runtime is not None:
            self.runtime.shutdown()
        if self.tm is not None:
            await self.tm.close()

    # ---- used by the routes -----------------------------------------------------------
    def ready_tm(self) -> TokenizerManager:
        """The TokenizerManager, or a 503 while the server is not serving."""
        if self.status != "ready" or self.tm is None:
            message = {
                "starting": "the server is starting up",
                "failed": "the server failed to start",
                "dead": (self.tm.dead_reason if self.tm else None) or "the runtime is down",
                "draining": SHUTDOWN_REASON,
            }[self.status]
            raise APIError(503, message)
        return self.tm

    def ready_openai(self) -> OpenAIServing:
        self.ready_tm()
        assert self.openai is not None  # set by the boot, before the server is ready
        return self.openai

    def ready_adapters(self) -> ServedAdapters:
        self.ready_tm()
        assert self.adapters is not None  # set by the boot, before the server is ready
        return self.adapters

    async def healthy(self) -> bool:
        tm = self.ready_tm()
        try:
            return bool(await tm.control("health", timeout=HEALTH_TIMEOUT_S))
        except (asyncio.TimeoutError, RuntimeError):
            return False

    @staticmethod
    async def generate_one_token(tm: TokenizerManager) -> dict[str, Any]:
        """The warm-up and ``/health_generate``: one greedy token, or one embedding
        from an embedding model."""
        if tm.embedding is not None:
            inp = GenerateInput(text="Hello", embed=True)
        else:
            inp = GenerateInput(text="Hello", sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        outs = [out async for out in tm.generate(inp)]
        return outs[-1]

    async def server_info(self) -> dict[str, Any]:
        """SGLang's shape (the flags at the top level, then the runtime's summary and
        stats, ``internal_states`` per replica, ``version``) plus ours: the flags again
        under ``server_args``, ``worker`` (what a router needs), in-flight requests, pids."""
        tm = self.ready_tm()
        runtime = self._runtime()
        info = await tm.control("server_info")
        args = dataclasses.asdict(self.args)
        for name in SECRET_ARGS:
            if args.get(name):
                args[name] = "<redacted>"
        return {
            **args,
            **info,
            "internal_states": internal_states(info),
            "version": _version(),
            "model_path": self.model_path,
            "served_model_name": self.model_name,
            "server_args": args,
            "worker": worker_facts(
                info, self.args.dp_size, embedding=tm.embedding is not None, prefill_step_tokens=self._prefill_step()
            ),
            "num_in_flight": tm.num_in_flight,
            "pids": {p.name: p.pid for p in runtime.processes},
        }

    def _prefill_step(self) -> int:
        """The most prompt tokens one prefill step computes: a chunk, within the batch's limit."""
        chunk = self.args.chunk_size
        return min(chunk, self.args.max_prefill_tokens) if chunk is not None else self.args.max_prefill_tokens

    def model_info(self) -> dict[str, Any]:
        tm = self.ready_tm()
        runtime = self._runtime()
        return {
            "model_path": self.model_path,
            "served_model_name": self.model_name,
            "tokenizer_path": runtime.tokenizer_path,
            "is_generation": tm.embedding is None,
            "architecture": runtime.summary["architecture"],
            "context_length": tm.context_length,
            "vocab_size": tm.vocab_size,
            "has_chat_template": self.ready_openai().chat_template.available,
        }

    def _runtime(self) -> RuntimeProcesses:
        """The runtime's processes, once ``ready_tm`` found the server ready."""
        assert self.runtime is not None  # spawned by the boot, before the server is ready
        return self.runtime


def _version() -> str:
    from radixserve.version import __version__

    return __version__
