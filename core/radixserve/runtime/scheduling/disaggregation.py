"""Prefill/decode disaggregation, the scheduler's two parts (``--disaggregation-mode``).

A gateway sends one request to a prefill worker and a decode worker with the same
bootstrap fields (``messages.Bootstrap``: the prefill worker's host and bootstrap port,
and a room):

- the decode worker (``DecodeArrivals``) preallocates KV slots for the prompt, opens the
  room on its KV receiver, and tells the prefill worker's bootstrap listener where the
  room's KV is to go; the request waits beside the running batch, which goes on; once
  the KV and the first token have come, it joins the batch and decodes;
- the prefill worker (``PrefillHandoff``) prefills the request as any other (radix
  cache, chunked prefill), samples its first token and answers its own client with it;
  it keeps the request's KV until the decode worker has acknowledged all of it, and
  only then releases it (to its prefix cache).

Both are plain objects the scheduler calls at each step; neither waits on the network
(the transfer backend's threads and the bootstrap listener's do). A room that fails
(a refusal at the handshake, a timeout, a prefill worker gone) frees its KV on both
sides: the decode side ends its request with a 502 saying why.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from radixserve.cache.memory_pool import KVPool, LatentKVPool
from radixserve.config import ServerArgs
from radixserve.ipc import RouterService
from radixserve.kernels.kv_transfer import (
    KVReceiver,
    KVSender,
    KVSide,
    TransferRefused,
    TransferState,
    TransferStatus,
    dtype_name,
)
from radixserve.messages import Bootstrap, FinishReason, RoomRegistration
from radixserve.registry import PluginRegistry
from radixserve.runtime.execution.distributed import TPGroup
from radixserve.runtime.execution.request import Req

logger = logging.getLogger(__name__)


def kv_side(pool: KVPool, platform: str, group: TPGroup) -> KVSide:
    """What this rank's KV pool is, for the other side: tensor-parallel rank ``r`` of
    ``n`` holds the model's KV heads ``[r * h, (r + 1) * h)``. (Where a model has fewer
    KV heads than ranks, each is held twice or more, and the other side must replicate
    alike: the handshake compares the head counts.)"""
    dtype = dtype_name(pool.dtype)
    if isinstance(pool, LatentKVPool):  # one latent entry per token and layer, on every rank
        width = pool.get_latent(0).shape[-1]
        return KVSide(platform, dtype, pool.num_layers, width, 1, (0, 1), pool.page_size, latent=True)
    heads = pool.k_buffers[0].shape[1]
    return KVSide(
        device=platform,
        dtype=dtype,
        num_layers=pool.num_layers,
        head_dim=pool.k_buffers[0].shape[-1],
        total_kv_heads=heads * group.size,
        heads=(group.rank * heads, (group.rank + 1) * heads),
        page_size=pool.page_size,
        head_major=pool.layout.head_major,
    )


def transfer_failed(reason: str) -> FinishReason:
    return FinishReason(type="abort", message=f"prefill/decode transfer failed: {reason}", status_code=502)


# A room's state on one rank, agreed over the tensor-parallel ranks (``_agreed``): every
# rank acts on a room at the same step, so that their KV ledgers stay alike.
WAITING, ARRIVED, FAILED = 0, 1, 2


def _agreed(group: TPGroup, local: list[int]) -> list[int]:
    """FAILED where any rank failed, ARRIVED where every rank arrived, else WAITING."""
    lowest, highest = group.min_max(local)
    pairs = zip(lowest, highest, strict=True)
    return [FAILED if hi == FAILED else ARRIVED if lo == ARRIVED else WAITING for lo, hi in pairs]


def _local(status: TransferStatus) -> int:
    return {TransferState.PENDING: WAITING, TransferState.DONE: ARRIVED}.get(status.state, FAILED)


# ---- the prefill side --------------------------------------------------------------------
class BootstrapListener:
    """The prefill worker's bootstrap port (rank 0's): decode workers register where
    each room's KV is to go; its socket has a thread of its own. ``take`` hands the
    registrations to the scheduler process, which passes them to every rank."""

    def __init__(self, host: str, port: int):
        self._registrations: list[RoomRegistration] = []
        self._lock = threading.Lock()
        self._service = RouterService(f"tcp://{host}:{port}", self._register, "bootstrap-listener")

    def take(self) -> list[RoomRegistration]:
        with self._lock:
            taken, self._registrations = self._registrations, []
        return taken

    def close(self) -> None:
        self._service.close()

    def _register(self, frames: list[zmq.Frame]) -> list[bytes]:
        body = frames[-1].bytes
        try:
            message = json.loads(body)
            receivers = tuple((str(e), (int(h[0]), int(h[1]))) for e, h in message["receivers"])
            registration = RoomRegistration(int(message["room"]), receivers, int(message.get("cached_tokens", 0)))
        except (ValueError, KeyError, TypeError, IndexError):
            logger.warning("bootstrap listener: a malformed registration was ignored: %r", body[:200])
            return []
        with self._lock:
            self._registrations.append(registration)
        return []


def registration_message(room: int, receivers: tuple[tuple[str, tuple[int, int]], ...], cached_tokens: int) -> bytes:
    """What a decode worker sends a prefill worker's bootstrap port."""
    body = {"room": room, "receivers": [[e, list(h)] for e, h in receivers], "cached_tokens": cached_tokens}
    return json.dumps(body).encode()


@dataclass
class _Handoff:
    req: Req
    slots: torch.Tensor
    metadata: bytes
    deadline: float
    sending: bool = False
    reason: str = ""  # why it failed on this rank


class PrefillHandoff:
    """Holds each prefilled request's KV until its decode worker has it. Every rank
    sends its own heads to the decode ranks that hold them."""

    def __init__(self, args: ServerArgs, pool: KVPool, side: KVSide, registry: PluginRegistry, group: TPGroup):
        backend = registry.kv_transfer_backend(args.disaggregation_transfer_backend, side)
        self.side, self.group, self.timeout_s = side, group, args.disaggregation_timeout_secs
        self.sender: KVSender = backend.open_sender(pool, side)
        port = args.disaggregation_bootstrap_port
        self.listener = BootstrapListener(args.host, port) if group.is_leader else None
        self._held: dict[int, _Handoff] = {}
        # room -> (its registration, when it came); kept a while for a request not held yet
        self._registered: dict[int, tuple[RoomRegistration, float]] = {}
        self._connected: set[str] = set()

    def __len__(self) -> int:
        return len(self._held)

    def registrations(self) -> list[RoomRegistration]:
        """The rooms registered since the last call (rank 0's listener; none elsewhere)."""
        return self.listener.take() if self.listener is not None else []

    def register(self, registration: RoomRegistration) -> None:
        self._registered[registration.room] = (registration, time.monotonic())

    def hold(self, req: Req, token_table: torch.Tensor) -> Req | None:
        """Keep a request whose prompt is computed and whose first token is sampled
        until its KV is handed over (``req.bootstrap`` names its room). A request held
        for the same room already (a client that reused a room) is given back to be
        released: its room is now the new one's."""
        assert req.bootstrap is not None and req.kv is not None
        prompt = len(req.origin_input_ids)
        slots = token_table[req.kv.row, :prompt].clone()
        first: dict[str, Any] = {"token": req.output_ids[0]}
        if req.output_token_logprobs:
            first["logprob"] = req.output_token_logprobs[0][0]
        if req.output_top_logprobs:
            first["top_logprobs"] = req.output_top_logprobs[0]
        if req.input_token_logprobs is not None:  # prompt logprobs asked for: the decode side has no prompt pass
            first["input_token_logprobs"] = req.input_token_logprobs
            first["input_top_logprobs"] = req.input_top_logprobs
        metadata = json.dumps(first).encode()
        displaced = self._held.pop(req.bootstrap.room, None)
        if displaced is not None:
            logger.warning("room %d was reused by %s: %s is released", req.bootstrap.room, req.rid, displaced.req.rid)
            if displaced.sending:
                self.sender.forget(req.bootstrap.room)
        self._held[req.bootstrap.room] = _Handoff(req, slots, metadata, time.monotonic() + self.timeout_s)
        return displaced.req if displaced is not None else None

    def poll(self, release: Callable[[Req], None]) -> None:
        """Start the handovers whose receivers are known; ``release`` the requests whose
        handover ended on every rank (acknowledged, refused or timed out)."""
        rooms = list(self._held)
        for room, state in zip(rooms, _agreed(self.group, [self._advance(room) for room in rooms]), strict=True):
            if state == WAITING:
                continue
            handoff = self._held.pop(room)
            if state == FAILED:
                reason = handoff.reason or "the transfer of another tensor-parallel rank failed"
                logger.warning("request %s: its KV did not reach the decode worker: %s", handoff.req.rid, reason)
            self.sender.forget(room)
            self._registered.pop(room, None)
            release(handoff.req)
        stale = time.monotonic() - 2 * self.timeout_s  # registrations of requests this worker never held
        for room in [r for r, (_, at) in self._registered.items() if at < stale and r not in self._held]:
            del self._registered[room]

    def _advance(self, room: int) -> int:
        """This rank's state of ``room``, starting its sends once the decode worker has
        registered the room."""
        handoff = self._held[room]
        if handoff.reason:
            return FAILED
        if handoff.sending:
            status = self.sender.poll(room)
            handoff.reason = status.reason if status.state is TransferState.FAILED else ""
            return _local(status)
        if room not in self._registered:
            if time.monotonic() > handoff.deadline:
                handoff.reason = f"no decode worker registered room {room} in {self.timeout_s:g} s"
                return FAILED
            return WAITING
        registration, _ = self._registered[room]
        targets = [endpoint for endpoint, heads in registration.receivers if _overlap(self.side.heads, heads)]
        try:
            for endpoint in (e for e in targets if e not in self._connected):
                self.sender.connect(endpoint, min(10.0, self.timeout_s))
                self._connected.add(endpoint)
        except (TransferRefused, TimeoutError) as exc:
            handoff.reason = str(exc)
            return FAILED
        remaining = max(handoff.deadline - time.monotonic(), 1.0)
        # the prompt's tokens the decode worker does not cache already
        self.sender.send(room, handoff.slots[registration.cached_tokens :], targets, remaining, handoff.metadata)
        handoff.sending = True
        return WAITING

    def close(self) -> None:
        self.sender.close()
        if self.listener is not None:
            self.listener.close()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


# ---- the decode side ---------------------------------------------------------------------
@dataclass
class _Arrival:
    req: Req
    deadline: float
    room_open: bool = False


@dataclass
class FirstToken:
    """What the prefill worker sent with the KV: the first token, its logprobs, and the
    prompt's logprobs when the request asked for them."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[float, int]] | None = None
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None

    @classmethod
    def of(cls, metadata: bytes) -> FirstToken:
        fields = json.loads(metadata)

        def pairs(items: list[list[Any]]) -> list[tuple[Any, int]]:
            return [(p[0], int(p[1])) for p in items]

        inputs = fields.get("input_token_logprobs")
        input_tops = fields.get("input_top_logprobs")
        return cls(
            int(fields["token"]),
            fields.get("logprob"),
            pairs(fields["top_logprobs"]) if fields.get("top_logprobs") else None,
            pairs(inputs) if inputs is not None else None,
            [pairs(t) if t is not None else None for t in input_tops] if input_tops is not None else None,
        )


class DecodeArrivals:
    """Requests waiting for their KV from a prefill worker: their slots preallocated,
    their rooms open on every rank's receiver, the prefill side told (by rank 0) where
    each rank's heads go."""

    def __init__(self, args: ServerArgs, pool: KVPool, side: KVSide, registry: PluginRegistry, group: TPGroup):
        backend = registry.kv_transfer_backend(args.disaggregation_transfer_backend, side)
        self.group, self.timeout_s = group, args.disaggregation_timeout_secs
        self.receiver: KVReceiver = backend.open_receiver(pool, side, args.host)
        # every rank's receiver and the heads it holds, in rank order (what rank 0 registers)
        self.receivers = tuple(group.gather((self.receiver.endpoint, side.heads)))
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._bootstraps: dict[tuple[str, int], zmq.Socket[Any]] = {}
        self._waiting: list[_Arrival] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req: Req) -> None:
        self._waiting.append(_Arrival(req, time.monotonic() + self.timeout_s))

    def requests(self) -> list[Req]:
        """The requests waiting here (for room, or for their KV)."""
        return [arrival.req for arrival in self._waiting]

    def remove(self, req: Req) -> bool:
        """Take ``req`` off (an abort); True when it was here. Its room is closed."""
        for arrival in self._waiting:
            if arrival.req is req:
                self._waiting.remove(arrival)
                self._close_room(arrival)
                return True
        return False

    def poll(
        self,
        open_room: Callable[[Req], tuple[torch.Tensor, int] | None],
        arrived: Callable[[Req, FirstToken], None],
        failed: Callable[[Req, FinishReason], None],
    ) -> None:
        """Open the rooms that ``open_room`` finds KV slots for (the slots of the prompt's
        tokens not cached here, and how many are cached; None: no room yet), hand the
        requests whose KV has come on every rank to ``arrived``, and those whose room
        failed on any to ``failed``."""
        arrivals = list(self._waiting)
        for arrival, state in zip(arrivals, _agreed(self.group, [self._state(a) for a in arrivals]), strict=True):
            req = arrival.req
            assert req.bootstrap is not None
            room = req.bootstrap.room
            if not arrival.room_open:
                if state == FAILED:
                    self._waiting.remove(arrival)
                    failed(req, transfer_failed(f"no room in the KV pool for {self.timeout_s:g} s"))
                    continue
                opened = open_room(req)  # alike on every rank: their ledgers are
                if opened is None:
                    continue
                slots, cached = opened
                try:
                    self.receiver.expect(room, slots, max(arrival.deadline - time.monotonic(), 1.0))
                except ValueError as exc:  # a room in use here already
                    self._waiting.remove(arrival)
                    failed(req, FinishReason(type="abort", status_code=400, message=str(exc)))
                    continue
                if self.group.is_leader:
                    self._register(req.bootstrap, cached)
                arrival.room_open = True
                continue
            if state == WAITING:
                continue
            self._waiting.remove(arrival)
            status = self.receiver.poll(room)
            if state == ARRIVED:
                first = FirstToken.of(self.receiver.metadata(room))
                self.receiver.forget(room)
                arrived(req, first)
            else:
                self.receiver.forget(room)
                reason = status.reason if status.state is TransferState.FAILED else "another rank's KV did not come"
                failed(req, transfer_failed(reason))

    def _state(self, arrival: _Arrival) -> int:
        if not arrival.room_open:
            return FAILED if time.monotonic() > arrival.deadline else WAITING
        assert arrival.req.bootstrap is not None
        return _local(self.receiver.poll(arrival.req.bootstrap.room))

    def _register(self, bootstrap: Bootstrap, cached_tokens: int) -> None:
        """Tell the prefill worker's bootstrap listener where the room's KV goes."""
        key = (bootstrap.host, bootstrap.port)
        socket = self._bootstraps.get(key)
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(f"tcp://{bootstrap.host}:{bootstrap.port}")
            self._bootstraps[key] = socket
        socket.send(registration_message(bootstrap.room, self.receivers, cached_tokens))

    def _close_room(self, arrival: _Arrival) -> None:
        if arrival.room_open and arrival.req.bootstrap is not None:
            self.receiver.forget(arrival.req.bootstrap.room)

    def close(self) -> None:
        self.receiver.close()
        for socket in self._bootstraps.values():
            socket.close()
