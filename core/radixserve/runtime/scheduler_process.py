"""The scheduler process: receive requests, step the Scheduler, send token batches."""

from __future__ import annotations

import logging
import traceback
from multiprocessing.connection import Connection
from typing import Optional

import zmq

from radixserve.config import ServerArgs
from radixserve.ipc import Endpoints, die_with_parent, pull_socket, push_socket
from radixserve.logging_utils import configure_logging
from radixserve.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    GenerateRequest,
    ReplicaFinished,
    TokenBatch,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50


def scheduler_process_name(dp_rank: Optional[int]) -> str:
    return "scheduler" if dp_rank is None else f"scheduler-dp{dp_rank}"


def run_scheduler_process(
    args: ServerArgs, model_path: str, endpoints: Endpoints, ready: Connection, dp_rank: Optional[int] = None
) -> None:
    """Load the model and serve. ``dp_rank``: this group's data-parallel rank
    behind the DP controller (None without one); ``endpoints.tokenizer_manager``
    is then the controller's, which also gets the ids of the requests that
    finished (``ReplicaFinished``) after their outputs went to the detokenizer."""
    die_with_parent()
    configure_logging(args.log_level, prefix=scheduler_process_name(dp_rank))
    try:
        from transformers import AutoTokenizer

        from radixserve.runtime.scheduler import Scheduler

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or model_path)
        scheduler = Scheduler(args, model_path, tokenizer)
    except Exception:
        ready.send({"error": traceback.format_exc()})
        return
    ready.send({"summary": scheduler.runner.summary()})
    ctx = zmq.Context()
    recv = pull_socket(ctx, endpoints.scheduler)
    to_detok = push_socket(ctx, endpoints.detokenizer)
    to_tm = push_socket(ctx, endpoints.tokenizer_manager)
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    checked_idle = False
    while True:
        if not scheduler.has_work():
            poller.poll(IDLE_POLL_MS)
        while True:
            try:
                msg = recv.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                break
            checked_idle = False
            try:
                _dispatch(scheduler, msg, to_tm)
            except Exception:  # one bad message must not stop the server
                logger.exception("failed to handle a %s message", type(msg).__name__)
        outputs = scheduler.step() if scheduler.has_work() else scheduler.step_outputs()
        scheduler.profiler.after_step()
        if outputs:
            to_detok.send_pyobj(TokenBatch(outputs))
            finished = [out.rid for out in outputs if out.finish_reason is not None]
            if dp_rank is not None and finished:
                to_tm.send_pyobj(ReplicaFinished(dp_rank, finished))
        if not scheduler.has_work() and not checked_idle:
            checked_idle = True
            if not scheduler.check_memory():
                logger.error("KV memory invariant broken while idle: %s", scheduler.stats())


def _dispatch(scheduler, msg, to_tm) -> None:
    if isinstance(msg, GenerateRequest):
        scheduler.add_request(msg)
    elif isinstance(msg, AbortRequest):
        scheduler.abort(msg.rid)
    elif isinstance(msg, ControlRequest):
        to_tm.send_pyobj(ControlReply(msg.kind, msg.call_id, _control(scheduler, msg.kind, msg.args)))
    else:
        logger.error("unknown message %r", type(msg).__name__)


def _control(scheduler, kind: str, args):
    if kind == "server_info":
        return {"stats": scheduler.stats().__dict__, **scheduler.runner.summary()}
    if kind == "flush_cache":
        return scheduler.flush_cache()
    if kind == "health":
        return True
    if kind in ("start_profile", "stop_profile"):
        try:
            path = scheduler.profiler.start(args) if kind == "start_profile" else scheduler.profiler.stop()
        except ValueError as exc:  # the profiler's refusals (ProfileError)
            return {"error": str(exc)}
        return {"trace_path": path}
    return {"error": f"unknown control request {kind!r}"}
