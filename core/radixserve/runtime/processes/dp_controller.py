"""The data-parallel controller (``--dp-size`` > 1): one process between the
TokenizerManager and the replicas, each a scheduler group as the runtime spawns
it (``runtime/processes/spawn.py``), reached only through its rank 0's ZMQ socket.

It PULLs where the TokenizerManager sends, so the TokenizerManager is the same
with or without it:

- ``GenerateRequest``: to one live replica, chosen by the ``LoadBalancer``;
- ``AbortRequest``: to the replica running the request ("" to every replica);
- ``ControlRequest``: to every live replica, each under a call id of the
  controller's own; once all have answered (or died) one merged ``ControlReply``
  goes to the TokenizerManager (``merge_replies``).

Replicas send their token batches straight to the detokenizer; the controller
never sees tokens.

**Load accounting.** The controller counts, per replica, the requests it has
dispatched that have not finished, and their tokens (prompt + max_new_tokens).
A replica tells it which requests finished (``ReplicaFinished``: their ids,
sent in the loop iteration that sent their final outputs, and only when some
finished). Counting at dispatch is exact the moment a request is sent, so a
burst of requests arriving faster than any replica steps spreads over the
replicas at once, which load reported by the replicas (a step or more old)
would not do; it costs one small message per loop iteration that finishes
something, rather than one per step. The same bookkeeping says which requests
to end when a replica dies.

**A replica's death.** The process watcher (``RuntimeProcesses.watch``) sends
``ReplicaDown``; the controller ends every request it had dispatched there
with a 500-coded abort (``FinishReason``, through the detokenizer, so each
client gets the usual error: an OpenAI error envelope, or an error event in a
stream), counts a control call's missing reply as given, stops dispatching to
it, logs it, and reports it in ``server_info`` (``replicas[k].error``). The
other replicas keep serving; the watcher ends the server when none is left.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.config import ServerArgs
from radixserve.ipc import Endpoints, die_with_parent, pull_socket, push_socket
from radixserve.load_balance import Load, LoadBalancer, request_tokens
from radixserve.logging_utils import configure_logging
from radixserve.messages import (
    PROFILE_DIR_ENV,
    AbortRequest,
    ControlReply,
    ControlRequest,
    DetokenizeSettings,
    FinishReason,
    GenerateRequest,
    ProfileOptions,
    ReplicaDown,
    ReplicaFinished,
    TokenBatch,
    TokenOutput,
)
from radixserve.rate_bands import sum_rates

logger = logging.getLogger(__name__)

Send = Callable[[Any], object]  # what it returns (zmq's send_pyobj: a tracker or None) is ignored


@dataclass
class _Replica:
    dp_rank: int
    load: Load = field(default_factory=Load)
    dispatched_total: int = 0
    down_reason: str | None = None  # set once it died


@dataclass
class _FanOut:
    """A control call sent to every live replica, waiting for their replies."""

    request: ControlRequest
    waiting: set[int]
    replies: dict[int, Any] = field(default_factory=dict)


class DPController:
    """The controller's state and decisions, without sockets (``send_replica(k,
    msg)``, ``send_detokenizer`` and ``send_tm`` deliver), so tests can drive it."""

    def __init__(
        self, args: ServerArgs, send_replica: Callable[[int, Any], object], send_detokenizer: Send, send_tm: Send
    ):
        self.args = args
        self.balancer = LoadBalancer(args.load_balance_method)
        self.replicas = [_Replica(k) for k in range(args.dp_size)]
        self._send_replica, self._send_detokenizer, self._send_tm = send_replica, send_detokenizer, send_tm
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (dp rank, its tokens)
        self._calls: dict[int, tuple[_FanOut, int]] = {}  # our call id -> (the fan-out, dp rank)
        self._call_ids = itertools.count(1)

    @property
    def live(self) -> list[int]:
        return [r.dp_rank for r in self.replicas if r.down_reason is None]

    def handle(self, msg: Any) -> None:
        if isinstance(msg, GenerateRequest):
            self._generate(msg)
        elif isinstance(msg, AbortRequest):
            self._abort(msg)
        elif isinstance(msg, ControlRequest):
            self._control(msg)
        elif isinstance(msg, ControlReply):
            self._control_reply(msg)
        elif isinstance(msg, ReplicaFinished):
            self._finished(msg)
        elif isinstance(msg, ReplicaDown):
            self._down(msg)
        else:
            logger.error("dropping an unexpected message of type %s", type(msg).__name__)

    # ---- requests -----------------------------------------------------------------
    def _generate(self, req: GenerateRequest) -> None:
        live = self.live
        if not live:
            self._fail([req.rid], "no data-parallel replica is alive")
            return
        k = self.balancer.choose({rank: self.replicas[rank].load for rank in live})
        tokens = request_tokens(req)
        self._owner[req.rid] = (k, tokens)
        replica = self.replicas[k]
        replica.load.add(tokens)
        replica.dispatched_total += 1
        self._send_replica(k, req)

    def _abort(self, msg: AbortRequest) -> None:
        if msg.rid == "":
            for k in self.live:
                self._send_replica(k, msg)
        elif msg.rid in self._owner:  # else it has finished already
            self._send_replica(self._owner[msg.rid][0], msg)

    def _finished(self, msg: ReplicaFinished) -> None:
        for rid in msg.rids:
            owner = self._owner.pop(rid, None)
            if owner is not None:
                self.replicas[owner[0]].load.remove(owner[1])

    def _down(self, msg: ReplicaDown) -> None:
        replica = self.replicas[msg.dp_rank]
        if replica.down_reason is not None:
            return
        replica.down_reason = msg.reason
        lost = [rid for rid, (k, _) in self._owner.items() if k == msg.dp_rank]
        for rid in lost:
            del self._owner[rid]
        replica.load = Load()
        logger.error(
            "data-parallel replica %d is down (%s): ending its %d request(s) with an error; %d of %d replicas serve on",
            msg.dp_rank,
            msg.reason,
            len(lost),
            len(self.live),
            len(self.replicas),
        )
        self._fail(lost, f"data-parallel replica {msg.dp_rank} died ({msg.reason})")
        for call_id, (fan, k) in list(self._calls.items()):
            if k == msg.dp_rank:
                del self._calls[call_id]
                fan.waiting.discard(k)
                self._maybe_reply(fan)

    def _fail(self, rids: list[str], message: str) -> None:
        """End ``rids`` with a 500-coded abort, through the detokenizer (which frees
        their text state) to the TokenizerManager."""
        if not rids:
            return
        finish = FinishReason(type="abort", message=message, status_code=500)
        # The settings serve a request that never reached the detokenizer; one that did keeps its own.
        self._send_detokenizer(
            TokenBatch([TokenOutput(rid, [], finish_reason=finish, detokenize=DetokenizeSettings()) for rid in rids])
        )

    # ---- control calls --------------------------------------------------------------
    def _control(self, req: ControlRequest) -> None:
        live = self.live
        if not live:  # the watcher is ending the server; its TokenizerManager fails the call
            logger.error("no replica left to answer %r", req.kind)
            return
        fan = _FanOut(req, set(live))
        per_replica = _profile_options(req.args, live) if req.kind == "start_profile" else {}
        for k in live:
            call_id = next(self._call_ids)
            self._calls[call_id] = (fan, k)
            self._send_replica(k, ControlRequest(req.kind, call_id, per_replica.get(k, req.args)))

    def _control_reply(self, reply: ControlReply) -> None:
        entry = self._calls.pop(reply.call_id, None)
        if entry is None:
            logger.warning("dropping a %r reply to an unknown call %d", reply.kind, reply.call_id)
            return
        fan, k = entry
        fan.replies[k] = reply.payload
        fan.waiting.discard(k)
        self._maybe_reply(fan)

    def _maybe_reply(self, fan: _FanOut) -> None:
        if fan.waiting:
            return
        if not fan.replies:
            logger.error("every replica died before answering %r", fan.request.kind)
            return
        payload = merge_replies(fan.request.kind, fan.replies)
        if fan.request.kind == "server_info":
            payload.update(self._replica_info(fan.replies))
        self._send_tm(ControlReply(fan.request.kind, fan.request.call_id, payload))

    def _replica_info(self, replies: dict[int, Any]) -> dict[str, Any]:
        """What ``server_info`` adds: the method and every replica's state."""
        return {
            "dp_size": len(self.replicas),
            "load_balance_method": self.balancer.method,
            "replicas": [
                {
                    "dp_rank": r.dp_rank,
                    "alive": r.down_reason is None,
                    "error": r.down_reason,
                    "requests_dispatched_total": r.dispatched_total,
                    "in_flight_requests": r.load.requests,
                    "in_flight_tokens": r.load.tokens,
                    "stats": replies[r.dp_rank]["stats"] if r.dp_rank in replies else None,
                }
                for r in self.replicas
            ],
        }


def _profile_options(options: ProfileOptions, ranks: list[int]) -> dict[int, ProfileOptions]:
    """Each replica's profile goes to a directory of its own (``dp<k>`` under the
    one asked for), since their traces would have the same names."""
    # The profiler's own default (runtime/execution/profiler.py, which would bring torch into this process).
    base = options.output_dir or os.environ.get(PROFILE_DIR_ENV)
    base = base or tempfile.mkdtemp(prefix="radixserve-profile-")
    return {k: dataclasses.replace(options, output_dir=os.path.join(base, f"dp{k}")) for k in ranks}


def merge_replies(kind: str, replies: dict[int, Any]) -> Any:
    """One reply to ``kind`` from the live replicas' (``replies`` by dp rank, not
    empty); ``server_info``: the first replica's summary and the stats' totals."""
    first = replies[min(replies)]
    if kind == "server_info":
        return {**first, "stats": total_stats({k: r["stats"] for k, r in replies.items()})}
    if kind in ("flush_cache", "health"):
        return all(replies.values())
    if kind in ("load_lora_adapter", "unload_lora_adapter"):  # every replica did alike: any refusal stands
        return next((r for _, r in sorted(replies.items()) if "error" in r), first)
    if kind in ("start_profile", "stop_profile"):
        errors = [f"replica {k}: {r['error']}" for k, r in sorted(replies.items()) if "error" in r]
        if errors:
            return {"error": "; ".join(errors)}
        return {"trace_path": first["trace_path"], "trace_paths": [replies[k]["trace_path"] for k in sorted(replies)]}
    return first  # the scheduler's own answer to a kind it does not know


def total_stats(per_replica: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The replicas' scheduler stats added up: counts and decode rates summed,
    ratios recomputed from the sums, the invariant holds where it holds on every replica. A stat of
    a kind not handled here is a TypeError, so a new one cannot be summed wrongly."""
    stats = [per_replica[k] for k in sorted(per_replica)]
    total: dict[str, Any] = {}
    for name, value in stats[0].items():
        values = [s[name] for s in stats]
        if name == "token_usage":  # each replica's fraction of its own pool
            pool = sum(s["max_total_tokens"] for s in stats)
            total[name] = sum(s[name] * s["max_total_tokens"] for s in stats) / pool
        elif name == "cache_hit_rate":
            prompt = sum(s["prompt_tokens_total"] for s in stats)
            total[name] = sum(s["cached_tokens_total"] for s in stats) / prompt if prompt else 0.0
        elif name in ("decode_tokens_per_s", "prefill_tokens_per_s"):  # None where a replica has not measured it
            rates = [v for v in values if v is not None]
            total[name] = sum(rates) if rates else None
        elif name.startswith(("decode_band_", "prefill_band_")):  # per band: rates and mean sizes
            total[name] = sum_rates(values)
        elif name == "memory_error":
            errors = [f"replica {k}: {s[name]}" for k, s in sorted(per_replica.items()) if s[name] is not None]
            total[name] = "; ".join(errors) or None
        elif isinstance(value, bool):
            total[name] = all(values)
        elif isinstance(value, int):
            total[name] = sum(values)
        else:
            raise TypeError(f"no total for the scheduler stat {name!r} = {value!r}")
    return total


def run_dp_controller_process(args: ServerArgs, endpoints: Endpoints) -> None:
    die_with_parent()
    configure_logging(args.log_level, prefix="dp-controller")
    ctx = zmq.Context()
    inbox = pull_socket(ctx, endpoints.scheduler)
    replicas = [push_socket(ctx, endpoints.for_replica(k).scheduler) for k in range(args.dp_size)]
    to_detokenizer = push_socket(ctx, endpoints.detokenizer)
    to_tm = push_socket(ctx, endpoints.tokenizer_manager)
    controller = DPController(
        args, lambda k, msg: replicas[k].send_pyobj(msg), to_detokenizer.send_pyobj, to_tm.send_pyobj
    )
    logger.info("dispatching to %d replicas (%s)", args.dp_size, args.load_balance_method)
    while True:
        try:
            msg = inbox.recv_pyobj()
        except Exception:  # names no request to fail
            logger.exception("dropping a message the DP controller cannot read")
            continue
        try:
            controller.handle(msg)
        except Exception:  # one bad message must not stop the server
            logger.exception("failed to handle a %s message", type(msg).__name__)
