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
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

import zmq
import zmq.asyncio

from radixserve.config import ServerArgs
from radixserve.ipc import Endpoints, pull_socket, push_socket
from radixserve.request_limits import request_fit_error
from radixserve.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    GenerateRequest,
    TextBatch,
    TextOutput,
)
from radixserve.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests are waiting than ``--max-queued-requests`` allows."""


class RuntimeDeadError(RuntimeError):
    """A runtime process died; no request can complete."""


@dataclass
class GenerateInput:
    """One prompt as the native API takes it (SGLang's field names)."""

    text: Optional[str] = None
    input_ids: Optional[list[int]] = None
    sampling_params: Union[dict, SamplingParams, None] = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False
    rid: Optional[str] = None
    priority: int = 0


@dataclass
class PreparedInput:
    """A validated prompt: what ``prepare`` returns and ``generate`` accepts, so a
    caller that validates a whole batch up front does not tokenize twice."""

    obj: GenerateInput
    input_ids: list[int]
    params: SamplingParams


@dataclass
class _Pending:
    queue: asyncio.Queue
    created: float = field(default_factory=time.perf_counter)
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None


class TokenizerManager:
    def __init__(self, args: ServerArgs, tokenizer, endpoints: Endpoints, summary: dict, metrics: Any = None):
        """``summary`` is the scheduler's startup summary (ModelRunner.summary())."""
        self.args = args
        self.tokenizer = tokenizer
        self.context_length: int = summary["context_length"]
        self.vocab_size: int = summary["vocab_size"]
        self.kv_pool_tokens: int = summary["max_total_tokens"]
        self.page_size: int = summary["page_size"]
        self.metrics = metrics
        self._ctx = zmq.asyncio.Context()
        self._send = push_socket(self._ctx, endpoints.scheduler)
        self._recv = pull_socket(self._ctx, endpoints.tokenizer_manager)
        self._pending: dict[str, _Pending] = {}  # by internal request id
        self._aliases: dict[str, list[str]] = {}  # client rid -> its internal ids in flight
        self._internal_ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._loop_task: Optional[asyncio.Task] = None
        self.dead_reason: Optional[str] = None

    # ---- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        """Start routing replies; call from inside the event loop that serves requests."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._route_replies())

    async def _route_replies(self) -> None:
        while True:
            msg = await self._recv.recv_pyobj()
            if isinstance(msg, TextBatch):
                for out in msg.outputs:
                    pending = self._pending.get(out.token.rid)
                    if pending is not None:
                        pending.queue.put_nowait(out)
            elif isinstance(msg, ControlReply):
                fut = self._calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.payload)

    def fail_all(self, reason: str) -> None:
        """A child process died: wake every waiter with the reason."""
        self.dead_reason = reason
        for pending in self._pending.values():
            pending.queue.put_nowait(RuntimeDeadError(reason))
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
        return len(self._pending)

    # ---- validation ------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def prepare(self, obj: GenerateInput) -> PreparedInput:
        """Validate one prompt; ValueError names the offending field."""
        if obj.text is not None and obj.input_ids is not None:
            raise ValueError("text: give either text or input_ids, not both")
        if obj.input_ids is not None:
            ids = list(obj.input_ids)
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"input_ids: every id must be an integer in [0, {self.vocab_size})")
            field_name = "input_ids"
        elif obj.text is not None:
            if not isinstance(obj.text, str):
                raise ValueError("text: must be a string")
            ids = self.tokenize(obj.text)
            field_name = "text"
        else:
            raise ValueError("text: one of text or input_ids is required")
        params = obj.sampling_params if isinstance(obj.sampling_params, SamplingParams) \
            else SamplingParams.from_dict(obj.sampling_params)
        params.validate(self.vocab_size)
        error = request_fit_error(len(ids), params.max_new_tokens, self.context_length, self.kv_pool_tokens,
                                  self.page_size, prompt_field=field_name)
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
    async def generate(self, obj: Union[GenerateInput, PreparedInput]) -> AsyncIterator[dict]:
        """Yield results for one prompt: a dict per streamed delta (``stream``) or
        one per finished choice. With ``n > 1`` every dict carries its ``index``.
        A cancelled consumer (client gone) aborts the request and frees its KV.

        The scheduler sees unique internal request ids; the client's ``rid`` (or
        a fresh one) names them all, for ``abort`` and in ``meta_info["id"]``."""
        if self.dead_reason:
            raise RuntimeDeadError(self.dead_reason)
        prepared = obj if isinstance(obj, PreparedInput) else self.prepare(obj)
        obj, ids, params = prepared.obj, prepared.input_ids, prepared.params
        rid = obj.rid or uuid.uuid4().hex
        if rid in self._aliases:
            raise ValueError(f"rid: request id {rid!r} is already in flight")
        self._aliases[rid] = []
        try:
            if params.n == 1:
                async for out in self._run_one(rid, ids, params, obj, index=0):
                    yield out
                return
            cached = None
            if not self.args.disable_radix_cache:
                # Prefill the shared prompt once; the n children then hit it in the
                # cache. The request's own cache hit is the warm-up's.
                warm = SamplingParams.from_dict({"max_new_tokens": 0})
                async for out in self._run_one(rid, ids, warm, GenerateInput(input_ids=ids), index=0, observe=False):
                    cached = out["meta_info"]["cached_tokens"]
            streams = [self._run_one(rid, ids, _child_params(params, i), obj, index=i) for i in range(params.n)]
            async for out in merge_streams(streams):
                if cached is not None:
                    out["meta_info"]["cached_tokens"] = cached
                yield out
        finally:
            del self._aliases[rid]

    async def _run_one(self, rid: str, ids: list[int], params: SamplingParams, obj: GenerateInput,
                       index: int, observe: bool = True) -> AsyncIterator[dict]:
        internal = f"{rid}#{next(self._internal_ids)}"
        self._aliases[rid].append(internal)
        pending = self._pending[internal] = _Pending(asyncio.Queue())
        self._send.send_pyobj(GenerateRequest(
            rid=internal, input_ids=ids, sampling_params=params, return_logprob=obj.return_logprob,
            top_logprobs_num=obj.top_logprobs_num, logprob_start_len=obj.logprob_start_len,
            stream=obj.stream, priority=obj.priority,
        ))
        result = _Accumulator(rid, index, obj.stream)
        finished = False
        try:
            while not finished:
                item = await pending.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.token.finish_reason is not None
                if finished:
                    _raise_if_rejected(item.token.finish_reason)
                if observe:
                    self._observe(pending, item)
                chunk = result.add(item)
                if obj.stream or finished:
                    yield chunk
        finally:
            self._pending.pop(internal, None)
            self._aliases[rid].remove(internal)
            if not finished and self.dead_reason is None:
                self._send.send_pyobj(AbortRequest(internal))

    def _observe(self, pending: _Pending, item: TextOutput) -> None:
        now = time.perf_counter()
        n_new = len(item.token.new_token_ids)
        if self.metrics is not None and n_new:
            if pending.first_token_at is None:
                self.metrics.record_first_token(now - pending.created)
            elif pending.last_token_at is not None:
                self.metrics.record_inter_token((now - pending.last_token_at) / n_new)
        if n_new:
            pending.first_token_at = pending.first_token_at or now
            pending.last_token_at = now
        if item.token.finish_reason is not None and self.metrics is not None:
            t = item.token
            self.metrics.record_finish(now - pending.created, t.prompt_tokens, t.completion_tokens, t.cached_tokens)

    async def abort(self, rid: str) -> None:
        """Abort every scheduler request of the client's ``rid`` (all n choices)."""
        for internal in list(self._aliases.get(rid, ())):
            self._send.send_pyobj(AbortRequest(internal))

    # ---- control -------------------------------------------------------------------
    async def control(self, kind: str, timeout: float = 30.0) -> Any:
        if self.dead_reason:
            raise RuntimeDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send.send_pyobj(ControlRequest(kind, call_id))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)


def _raise_if_rejected(finish: dict) -> None:
    """The scheduler refused the request: a full queue (503) or input it cannot
    serve (400), raised as the exceptions the API layers map to those statuses."""
    if finish["type"] != "abort":
        return
    if finish.get("status_code") == 503:
        raise QueueFullError(finish["message"])
    if finish.get("status_code") == 400:
        raise ValueError(finish["message"])


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
        self.output_token_logprobs: list = []
        self.output_top_logprobs: list = []
        self.input_token_logprobs = None
        self.input_top_logprobs = None

    def add(self, item: TextOutput) -> dict:
        t = item.token
        self.text += item.new_text
        self.output_ids += t.new_token_ids
        self.output_token_logprobs += t.output_token_logprobs
        self.output_top_logprobs += t.output_top_logprobs
        if t.input_token_logprobs is not None:
            self.input_token_logprobs, self.input_top_logprobs = t.input_token_logprobs, t.input_top_logprobs
        meta = {
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
            logprobs = (self.output_token_logprobs, self.output_top_logprobs, self.input_token_logprobs,
                        self.input_top_logprobs)
        out_lp, out_top, in_lp, in_top = logprobs
        meta["output_token_logprobs"] = out_lp
        meta["output_top_logprobs"] = out_top
        if in_lp is not None:
            meta["input_token_logprobs"] = in_lp
            meta["input_top_logprobs"] = in_top
        return {"index": self.index, "text": text, "output_ids": list(ids), "meta_info": meta,
                "finished": t.finish_reason is not None}


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """Interleave several async iterators as their items arrive."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(stream: AsyncIterator[dict]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        except BaseException as exc:  # surfaced to the consumer below
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(drain(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
