"""The scheduler process: receive requests, step the Scheduler, send token batches.

With tensor parallelism one such process runs per rank. Rank 0 alone has the
ZMQ sockets: each loop iteration it passes the messages it received (possibly
none) to every rank (``TPGroup.broadcast``), so all ranks handle the same
messages in the same order, step identical Schedulers and run the same
collectives; only rank 0 sends token batches and control replies.
"""

from __future__ import annotations

import logging
import pickle
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

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
    RoomRegistration,
    ShutdownRequest,
    TokenBatch,
)
from radixserve.startup_gc import gc_paused

if TYPE_CHECKING:  # torch and transformers: the spawning server may not have imported them yet
    from radixserve.runtime.execution.distributed import RankSpec
    from radixserve.runtime.execution.model_plan import ModelPlan
    from radixserve.runtime.scheduling.scheduler import Scheduler

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50
# With only prefill/decode transfers pending: how long the loop waits for a message before it looks at them again.
TRANSFER_POLL_MS = 1


def scheduler_process_name(rank: RankSpec | None, dp_rank: int | None = None) -> str:
    """``scheduler``, ``scheduler-tp1``, ``scheduler-dp0``, ``scheduler-dp1-tp1``..."""
    parts = ["scheduler"]
    if dp_rank is not None:
        parts.append(f"dp{dp_rank}")
    if rank is not None:
        parts.append(f"tp{rank.rank}")
    return "-".join(parts)


def run_scheduler_process(
    args: ServerArgs,
    model_path: str,
    endpoints: Endpoints,
    ready: Connection,
    rank: RankSpec | None = None,
    dp_rank: int | None = None,
    plan: ModelPlan | None = None,
    held: Connection | None = None,
) -> None:
    """Load the model and serve until a ShutdownRequest. ``rank``: this process's
    tensor-parallel rank (None at tp_size 1). ``dp_rank``: its group's
    data-parallel rank behind the DP controller (None without one);
    ``endpoints.tokenizer_manager`` is then the controller's, which also gets the
    ids of the requests that finished (``ReplicaFinished``) after their outputs
    went to the detokenizer. ``plan``: the model plan the spawning process made
    (None on a node other than the first: rank 0 hands its own). ``held``: the
    plan comes later, on this pipe, once the server's start-up checks passed:
    the rank imports meanwhile and waits for it before reading the model; the
    pipe closing instead ends the process quietly (the server says what failed)."""
    die_with_parent()
    configure_logging(args.log_level, prefix=scheduler_process_name(rank, dp_rank))
    if rank is not None and rank.rank > 0:  # rank 0's stats lines speak for the group
        logging.getLogger("radixserve.runtime.scheduling.stats").setLevel(logging.WARNING)
    try:
        with gc_paused(freeze=True):
            from transformers import AutoTokenizer

            from radixserve.checkpoints.loader import import_config_class
            from radixserve.runtime.scheduling.scheduler import Scheduler

            if held is not None:
                import_config_class(model_path)  # while the server checks: unpickling the plan needs it
                released, plan = _released(held)
                if not released:
                    return
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or model_path)
            status: dict[str, Any] = {}
            if rank is None or rank.rank == 0:  # shared with the server and the detokenizer (tokenizer_share.py)
                status["tokenizer"] = pickle.dumps(tokenizer)  # as loaded: before the Scheduler holds it
            scheduler = Scheduler(args, model_path, tokenizer, rank=rank, plan=plan)
    except Exception:
        ready.send({"error": traceback.format_exc()})
        return
    ready.send({**status, "summary": scheduler.runner.summary()})
    group = scheduler.runner.group
    ctx = zmq.Context()
    leader = _LeaderSockets.open(ctx, endpoints) if group.is_leader else None
    to_tm = leader.to_tm if leader is not None else None
    checked_idle = False
    while True:
        messages: list[object] = []
        if leader is not None:
            if not scheduler.has_work():
                leader.poller.poll(IDLE_POLL_MS)
            elif scheduler.only_transfers_pending():
                leader.poller.poll(TRANSFER_POLL_MS)
            while True:
                try:
                    messages.append(leader.recv.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    break
            messages.extend(scheduler.bootstrap_registrations())  # a prefill worker's: for every rank
        # The other ranks wait here for rank 0's messages (at most IDLE_POLL_MS when idle).
        for msg in group.broadcast(messages):
            if isinstance(msg, ShutdownRequest):
                logger.info("shutting down")
                ctx.destroy(linger=0)
                group.destroy()
                return
            checked_idle = False
            try:
                _dispatch(scheduler, msg, to_tm)
            except Exception:  # one bad message must not stop the server
                logger.exception("failed to handle a %s message", type(msg).__name__)
        outputs = scheduler.step() if scheduler.has_work() else scheduler.step_outputs()
        scheduler.profiler.after_step()
        if outputs and leader is not None:
            leader.to_detok.send_pyobj(TokenBatch(outputs))
            finished = [out.rid for out in outputs if out.finish_reason is not None]
            if dp_rank is not None and finished:
                leader.to_tm.send_pyobj(ReplicaFinished(dp_rank, finished))
        if not scheduler.has_work() and not checked_idle:
            checked_idle = True
            if not scheduler.check_memory():
                logger.error("KV memory invariant broken while idle: %s", scheduler.stats())


@dataclass
class _LeaderSockets:
    """Rank 0's sockets: the requests in, token batches to the detokenizer, control
    replies (and, behind a DP controller, finished ids) to the tokenizer manager."""

    recv: zmq.Socket[bytes]
    to_detok: zmq.Socket[bytes]
    to_tm: zmq.Socket[bytes]
    poller: zmq.Poller

    @classmethod
    def open(cls, ctx: zmq.Context[zmq.Socket[bytes]], endpoints: Endpoints) -> _LeaderSockets:
        recv = pull_socket(ctx, endpoints.scheduler)
        poller = zmq.Poller()
        poller.register(recv, zmq.POLLIN)
        return cls(recv, push_socket(ctx, endpoints.detokenizer), push_socket(ctx, endpoints.tokenizer_manager), poller)


def _released(held: Connection) -> tuple[bool, ModelPlan | None]:
    """Whether the server let this rank go on, and the model plan it sent with
    its go (False: it closed the pipe instead)."""
    try:
        plan: ModelPlan | None = held.recv()
        return True, plan
    except EOFError:
        return False, None
    finally:
        held.close()


def _dispatch(scheduler: Scheduler, msg: object, to_tm: zmq.Socket[bytes] | None) -> None:
    """Handle one message; ``to_tm`` (rank 0's) gets control replies, other ranks only act."""
    if isinstance(msg, GenerateRequest):
        scheduler.add_request(msg)
    elif isinstance(msg, AbortRequest):
        scheduler.abort(msg.rid)
    elif isinstance(msg, RoomRegistration):
        scheduler.register_room(msg)
    elif isinstance(msg, ControlRequest):
        payload = _control(scheduler, msg.kind, msg.args)
        if to_tm is not None:
            to_tm.send_pyobj(ControlReply(msg.kind, msg.call_id, payload))
    else:
        logger.error("unknown message %r", type(msg).__name__)


def _control(scheduler: Scheduler, kind: str, args: Any) -> Any:
    if kind == "server_info":
        summary = scheduler.runner.summary()
        speculative = scheduler.speculation.describe() if scheduler.speculation is not None else None
        return {
            "stats": scheduler.stats().__dict__,
            **summary,
            "grammar_backend": scheduler.grammars.backend_name,
            "speculative": speculative,
        }
    if kind == "flush_cache":
        return scheduler.flush_cache()
    if kind == "load_lora_adapter":
        return scheduler.load_lora_adapter(args["lora_name"], args["lora_path"])
    if kind == "unload_lora_adapter":
        return scheduler.unload_lora_adapter(args["lora_name"])
    if kind == "health":
        return True
    if kind in ("start_profile", "stop_profile"):
        try:
            path = scheduler.profiler.start(args) if kind == "start_profile" else scheduler.profiler.stop()
        except ValueError as exc:  # the profiler's refusals (ProfileError)
            return {"error": str(exc)}
        return {"trace_path": path}
    return {"error": f"unknown control request {kind!r}"}
