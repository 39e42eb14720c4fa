"""TokenizerManager: the front half of the runtime, living in the server (or
Engine) process. It validates and tokenizes requests, sends them to the
scheduler, and routes text back to the coroutine waiting for each request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import zmq
import zmq.asyncio

from radixserve.checkpoints.embedding import EmbeddingConfig
from radixserve.config import ServerArgs
from radixserve.ipc import Endpoints, pull_socket, push_socket
from radixserve.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    FinishReason,
    GenerateRequest,
    ProfileOptions,
    RequestOptions,
    TextBatch,
    TextOutput,
)
from radixserve.request_limits import has_lone_surrogate, request_fit_error, token_ids_error
from radixserve.sampling.params import SamplingParams
from radixserve.server.access_log import current_request

if TYPE_CHECKING:
    from radixserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Writing a long trace with device events takes a while.
STOP_PROFILE_TIMEOUT_S = 300.0


class QueueFullError(RuntimeError):
    """More requests are waiting than ``--max-queued-requests`` allows."""


class RuntimeDeadError(RuntimeError):
    """A runtime process died; no request can complete."""


class RequestFailedError(RuntimeError):
    """This request (only) failed inside the runtime, e.g. its text could not be decoded
    (``status`` 500), or its KV never came from its prefill worker (502)."""

    def __init__(self, message: str | None, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass(kw_only=True)
class GenerateInput(RequestOptions):
    """One prompt as the native API takes it (SGLang's field names)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | SamplingParams | None = None
    rid: str | None = None


@dataclass
class PreparedInput:
    """A validated prompt: what ``prepare`` returns and ``generate`` accepts, so a
    caller that validates a whole batch up front does not tokenize twice."""

    obj: GenerateInput
    input_ids: list[int]
    params: SamplingParams


@dataclass
class _Pending:
    """One scheduler request (an internal id), tracked from its GenerateRequest
    until both its consumer is gone and the scheduler has sent its final output
    (or died): the tokens it makes after its client left, until the abort
    lands, still count in the metrics."""

    queue: asyncio.Queue[TextOutput | Exception] | None  # None once the consumer has gone
    scheduler_done: bool = False
    observe: bool = True  # counted in the metrics (warm-ups are not)
    created: float = field(default_factory=time.perf_counter)
    admitted: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None
    abort_sent: bool = False


class TokenizerManager:
    def __init__(
        self,
        args: ServerArgs,
        tokenizer: Any,
        endpoints: Endpoints,
        summary: dict[str, Any],
        metrics: ServerMetrics | None = None,
    ) -> None:
        """``summary`` is the scheduler's startup summary (ModelRunner.summary())."""
        self.args = args
        self.tokenizer = tokenizer
        self.context_length: int = summary["context_length"]
        self.vocab_size: int = summary["vocab_size"]
        self.kv_pool_tokens: int = summary["max_total_tokens"]
        self.page_size: int = summary["page_size"]
        # Set when the model is served for embeddings (radixserve/embedding_config.py): it then only embeds.
        embedding = summary.get("embedding")
        self.embedding = EmbeddingConfig(**embedding) if embedding is not None else None
        self.metrics = metrics
        self._ctx = zmq.asyncio.Context()
        self._send = push_socket(self._ctx, endpoints.scheduler)
        self._recv = pull_socket(self._ctx, endpoints.tokenizer_manager)
        self._pending: dict[str, _Pending] = {}  # by internal request id
        self._aliases: dict[str, list[str]] = {}  # client rid -> the internal ids it started
        self._internal_ids = itertools.count()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._loop_task: asyncio.Task[None] | None = None
        self.dead_reason: str | None = None

    # ---- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        """Start routing replies; call from inside the event loop that serves requests."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._route_replies())

    async def _route_replies(self) -> None:
        """Route each reply to its waiter. One bad message is logged and fails
        at most its own request: this loop must outlive anything it receives."""
        while True:
            try:
                msg = await self._recv.recv_pyobj()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("dropping a reply that cannot be read")
                continue
            try:
                self._dispatch(msg)
            except Exception:
                logger.exception("dropping a reply that cannot be routed")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, TextBatch):
            for out in msg.outputs:
                self._deliver(out)
        elif isinstance(msg, ControlReply):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.payload)
        else:
            logger.error("dropping an unexpected reply of type %s", type(msg).__name__)

    def _deliver(self, out: TextOutput) -> None:
        rid = getattr(getattr(out, "token", None), "rid", None)
        if not isinstance(rid, str):
            logger.error("dropping a malformed output: %.200r", out)
            return
        pending = self._pending.get(rid)
        if pending is None or pending.scheduler_done:
            return  # not ours, or already finished
        try:
            if out.token.finish_reason is not None:  # first, so that nothing below can keep it tracked
                pending.scheduler_done = True
                if pending.queue is None:
                    del self._pending[rid]
            self._observe(pending, out)
            if pending.queue is not None:
                pending.queue.put_nowait(out)
        except Exception as exc:
            logger.exception("a reply for request %s is broken; failing that request", rid)
            if pending.queue is not None:
                pending.queue.put_nowait(RequestFailedError(f"a broken reply from the runtime: {exc}"))

    def fail_all(self, reason: str) -> None:
        """A child process died: wake every waiter with the reason."""
        self.dead_reason = reason
        for internal, pending in list(self._pending.items()):
            if pending.queue is not None:
                pending.queue.put_nowait(RuntimeDeadError(reason))
            else:  # nobody waits, and nothing more will come
                del self._pending[internal]
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(RuntimeDeadError(reason))

    async def close(self) -> None:
        """Stop routing replies (awaiting the routing task, so it ends cleanly
        inside its loop) and close the sockets."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self._send.close()
        self._recv.close()
        self._ctx.term()

    @property
    def num_in_flight(self) -> int:
        """Scheduler requests that someone waits for or that the scheduler still
        runs (those whose client left, until their abort lands)."""
        return len(self._pending)

    # ---- validation ------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text)
        return ids

    def prepare(self, obj: GenerateInput) -> PreparedInput:
        """Validate one prompt; ValueError names the offending field."""
        if obj.text is not None and obj.input_ids is not None:
            raise ValueError("text: give either text or input_ids, not both")
        if obj.input_ids is not None:
            ids = list(obj.input_ids)
            error = token_ids_error(ids, self.vocab_size)
            if error is not None:
                raise ValueError(error)
            field_name = "input_ids"
        elif obj.text is not None:
            if not isinstance(obj.text, str):
                raise ValueError("text: must be a string")
            if has_lone_surrogate(obj.text):
                raise ValueError("text: contains a lone UTF-16 surrogate, which is not valid text")
            ids = self.tokenize(obj.text)
            field_name = "text"
        else:
            raise ValueError("text: one of text or input_ids is required")
        if obj.embed != (self.embedding is not None):
            raise ValueError(
                "model: the model is served for embeddings (/v1/embeddings, Engine.encode); it does not generate"
                if self.embedding is not None
                else "model: the model is served for generation; embeddings need an embedding model "
                "(radixserve serve --is-embedding)"
            )
        if obj.embed:  # a bare prefill: whatever sampling parameters came, it samples nothing
            params = SamplingParams(max_new_tokens=0)
        elif isinstance(obj.sampling_params, SamplingParams):
            params = obj.sampling_params
        else:
            params = SamplingParams.from_dict(obj.sampling_params)
        params.validate(self.vocab_size, self.args)  # the request limits are flags
        error = request_fit_error(
            len(ids),
            params.max_new_tokens,
            self.context_length,
            self.kv_pool_tokens,
            self.page_size,
            prompt_field=field_name,
        )
        if error is not None:
            raise ValueError(error)
        if obj.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num: must be >= 0, got {obj.top_logprobs_num}")
        if obj.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len: must be >= -1, got {obj.logprob_start_len}")
        if obj.rid is not None and obj.rid in self._aliases:
            raise ValueError(f"rid: request id {obj.rid!r} is already in flight")
        return PreparedInput(obj, ids, params)

    # ---- generation --------------------------------------------------------------
    async def generate(self, obj: GenerateInput | PreparedInput) -> AsyncGenerator[dict[str, Any], None]:
        """Yield results for one prompt: a dict per streamed delta (``stream``) or
        one per finished choice. With ``n > 1`` every dict carries its ``index``.
        A cancelled consumer (client gone) aborts the request and frees its KV.

        The scheduler sees unique internal request ids; the client's ``rid`` (or
        a fresh one) names them all, for ``abort`` and in ``meta_info["id"]``.
        ``meta_info["finish_reason"]`` is the runtime's ``FinishReason`` (None
        until the choice ends): each API renders it in its own JSON. An
        embedding request (``embed``) yields one dict, with its ``embedding``."""
        if self.dead_reason:
            raise RuntimeDeadError(self.dead_reason)
        prepared = obj if isinstance(obj, PreparedInput) else self.prepare(obj)
        obj, ids, params = prepared.obj, prepared.input_ids, prepared.params
        rid = obj.rid or uuid.uuid4().hex
        if rid in self._aliases:
            raise ValueError(f"rid: request id {rid!r} is already in flight")
        group = self._aliases[rid] = []
        try:
            if params.n == 1:
                async with contextlib.aclosing(self._run_one(rid, group, ids, params, obj, index=0)) as one:
                    async for out in one:
                        yield out
                return
            cached = None
            # A decode worker of a pair gets each sample's KV from the prefill worker: no warm-up.
            awaits_kv = obj.bootstrap is not None and self.args.disaggregation_mode == "decode"
            if not self.args.disable_radix_cache and not awaits_kv:
                # Prefill the shared prompt once; the n children then hit it in the
                # cache. The request's own cache hit is the warm-up's.
                warm = SamplingParams.from_dict({"max_new_tokens": 0})
                warm_input = GenerateInput(input_ids=ids, priority=obj.priority)
                async with contextlib.aclosing(
                    self._run_one(rid, group, ids, warm, warm_input, index=0, observe=False)
                ) as warm_up:
                    async for out in warm_up:
                        cached = out["meta_info"]["cached_tokens"]
            streams = [
                self._run_one(rid, group, ids, _child_params(params, i), _child_input(obj, i, params.n), index=i)
                for i in range(params.n)
            ]
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for out in merged:
                    if cached is not None:
                        out["meta_info"]["cached_tokens"] = cached
                    yield out
        finally:
            # However this generator ends (finished, failed, cancelled, closed, or
            # collected late), every id it started that the scheduler still runs
            # is aborted, once; nothing here waits, so nothing here can be cut short.
            del self._aliases[rid]
            for internal in group:
                self._release(internal)

    async def _run_one(
        self,
        rid: str,
        group: list[str],
        ids: list[int],
        params: SamplingParams,
        obj: GenerateInput,
        index: int,
        observe: bool = True,
    ) -> AsyncGenerator[dict[str, Any], None]:
        internal = f"{rid}#{next(self._internal_ids)}"
        group.append(internal)
        queue: asyncio.Queue[TextOutput | Exception] = asyncio.Queue()
        self._pending[internal] = _Pending(queue, observe=observe)
        self._send.send_pyobj(GenerateRequest(rid=internal, input_ids=ids, sampling_params=params, **obj.options()))
        result = _Accumulator(rid, index, obj.stream)
        record = current_request.get() if observe else None  # the HTTP request's, for the access log
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    raise RequestFailedError(item.error)
                if record is not None:
                    record.update(rid, internal, item.token)
                finish = item.token.finish_reason
                finished = finish is not None
                if finish is not None:
                    _raise_if_rejected(finish)
                chunk = result.add(item)
                if obj.stream or finished:
                    yield chunk
                if finished:
                    return
        finally:
            self._release(internal)

    def _release(self, internal: str) -> None:
        """The consumer of ``internal`` is gone: stop queueing its outputs and
        abort it if the scheduler still runs it. Idempotent."""
        pending = self._pending.get(internal)
        if pending is None:
            return
        pending.queue = None
        if pending.scheduler_done or self.dead_reason is not None:
            del self._pending[internal]
        else:
            self._abort_once(internal, pending)

    def _abort_once(self, internal: str, pending: _Pending) -> None:
        if not pending.abort_sent and self.dead_reason is None:
            pending.abort_sent = True
            self._send.send_pyobj(AbortRequest(internal))

    def _observe(self, pending: _Pending, item: TextOutput) -> None:
        """Feed the metrics from every output of an observed request, whether or
        not its client still listens, so they count what the scheduler did."""
        if self.metrics is None or not pending.observe:
            return
        t, now = item.token, time.perf_counter()
        if not pending.admitted and t.queue_time is not None:
            pending.admitted = True
            self.metrics.record_admitted(t.queue_time, t.prompt_tokens, t.cached_tokens)
        n_new = len(t.new_token_ids)
        if n_new:
            if pending.last_token_at is None:  # the first token (first_token_at is set with it)
                self.metrics.record_first_token(now - pending.created)
                pending.first_token_at = now
            else:
                self.metrics.record_inter_token((now - pending.last_token_at) / n_new)
            pending.last_token_at = now
            self.metrics.record_generated(n_new)
        if t.finish_reason is not None:
            self.metrics.record_finish(now - pending.created, t.finish_reason.type)

    async def abort(self, rid: str) -> None:
        """Abort every scheduler request of the client's ``rid`` (all n choices)."""
        for internal in self._aliases.get(rid, ()):
            pending = self._pending.get(internal)
            if pending is not None and not pending.scheduler_done:
                self._abort_once(internal, pending)

    # ---- control -------------------------------------------------------------------
    async def control(self, kind: str, timeout: float = 30.0, args: Any = None) -> Any:
        if self.dead_reason:
            raise RuntimeDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send.send_pyobj(ControlRequest(kind, call_id, args))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def start_profile(self, options: ProfileOptions) -> str:
        """Start torch.profiler in the scheduler; the path its trace will have.
        A refusal (already profiling, an output_dir it cannot write) is a ValueError."""
        return _trace_path(await self.control("start_profile", args=options))

    async def stop_profile(self) -> str:
        """Stop the profile (unless it stopped by itself after ``num_steps``) and
        return its trace path; a ValueError when none was started."""
        return _trace_path(await self.control("stop_profile", timeout=STOP_PROFILE_TIMEOUT_S))


def _trace_path(reply: dict[str, Any]) -> str:
    if "error" in reply:
        raise ValueError(reply["error"])
    path: str = reply["trace_path"]
    return path


def _raise_if_rejected(finish: FinishReason) -> None:
    """The scheduler refused the request (a full queue, 503; input it cannot
    serve, 400) or failed on it (500; 502: its prefill worker's KV never came),
    raised as the exceptions the API layers map to those statuses."""
    if finish.type != "abort":
        return
    if finish.status_code == 503:
        raise QueueFullError(finish.message)
    if finish.status_code == 400:
        raise ValueError(finish.message)
    if finish.status_code in (500, 502):
        raise RequestFailedError(finish.message, finish.status_code)


def _child_input(obj: GenerateInput, index: int, n: int) -> GenerateInput:
    """Choice ``index`` of an n>1 request: its own room when it is half of a prefill/decode pair."""
    if obj.bootstrap is None:
        return obj
    return dataclasses.replace(obj, bootstrap=obj.bootstrap.for_sample(index, n))


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of an n>1 request: one sample, its own seed so choices differ."""
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed)


class _Accumulator:
    """Builds the result dicts of one choice from its TextOutputs."""

    def __init__(self, rid: str, index: int, stream: bool):
        self.rid, self.index, self.stream = rid, index, stream
        self.text = ""
        self.output_ids: list[int] = []
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_token_logprobs: list[tuple[float | None, int]] | None = None
        self.input_top_logprobs: list[list[tuple[float, int]] | None] | None = None

    def add(self, item: TextOutput) -> dict[str, Any]:
        t = item.token
        self.text += item.new_text
        self.output_ids += t.new_token_ids
        self.output_token_logprobs += t.output_token_logprobs
        self.output_top_logprobs += t.output_top_logprobs
        if t.input_token_logprobs is not None:
            self.input_token_logprobs, self.input_top_logprobs = t.input_token_logprobs, t.input_top_logprobs
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "cached_tokens": t.cached_tokens,
            "finish_reason": t.finish_reason,
        }
        if self.stream:  # deltas
            text, ids = item.new_text, t.new_token_ids
            logprobs = (t.output_token_logprobs, t.output_top_logprobs, t.input_token_logprobs, t.input_top_logprobs)
        else:
            text, ids = self.text, self.output_ids
            logprobs = (
                self.output_token_logprobs,
                self.output_top_logprobs,
                self.input_token_logprobs,
                self.input_top_logprobs,
            )
        out_lp, out_top, in_lp, in_top = logprobs
        meta["output_token_logprobs"] = out_lp
        meta["output_top_logprobs"] = out_top
        if in_lp is not None:
            meta["input_token_logprobs"] = in_lp
            meta["input_top_logprobs"] = in_top
        out: dict[str, Any] = {
            "index": self.index,
            "text": text,
            "output_ids": list(ids),
            "meta_info": meta,
            "finished": t.finish_reason is not None,
        }
        if t.embedding is not None:  # an embedding request's result
            out["embedding"] = t.embedding
        return out


async def merge_streams(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
    """Interleave several async generators as their items arrive. The first
    error in any of them is raised here. However the merged generator ends, it
    cancels the streams still running and waits for them, so every stream's
    cleanup (aborting its request) has run when it is closed."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def drain(stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait(item)
        except Exception as exc:  # surfaced to the consumer below
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.create_task(drain(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
