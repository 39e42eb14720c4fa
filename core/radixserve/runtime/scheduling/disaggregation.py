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
from radixserve.kernels.kv_transfer import KVReceiver, KVSender, KVSide, TransferRefused, TransferState
from radixserve.messages import Bootstrap, FinishReason
from radixserve.registry import PluginRegistry
from radixserve.runtime.execution.request import Req

logger = logging.getLogger(__name__)


def kv_side(pool: KVPool, platform: str) -> KVSide:
    """What this worker's KV pool is, for the other side (tensor parallelism 1: every head here)."""
    if isinstance(pool, LatentKVPool):  # one latent entry per token and layer
        dtype = str(pool.dtype).removeprefix("torch.")
        width = pool.get_latent(0).shape[-1]
        return KVSide(platform, dtype, pool.num_layers, width, 1, (0, 1), pool.page_size, latent=True)
    heads = pool.k_buffers[0].shape[1]
    return KVSide(
        device=platform,
        dtype=str(pool.dtype).removeprefix("torch."),
        num_layers=pool.num_layers,
        head_dim=pool.k_buffers[0].shape[-1],
        total_kv_heads=heads,
        heads=(0, heads),
        page_size=pool.page_size,
        head_major=pool.layout.head_major,
    )


def transfer_failed(reason: str) -> FinishReason:
    return FinishReason(type="abort", message=f"prefill/decode transfer failed: {reason}", status_code=502)


# ---- the prefill side --------------------------------------------------------------------
class BootstrapListener:
    """The prefill worker's bootstrap port: decode workers register where each room's KV
    is to go (``{"room", "endpoint"}``); its socket has a thread of its own."""

    def __init__(self, host: str, port: int):
        self._destinations: dict[int, str] = {}
        self._lock = threading.Lock()
        self._service = RouterService(f"tcp://{host}:{port}", self._register, "bootstrap-listener")

    def destination(self, room: int) -> str | None:
        """The endpoint a decode worker registered for ``room``, once it has."""
        with self._lock:
            return self._destinations.get(room)

    def forget(self, room: int) -> None:
        with self._lock:
            self._destinations.pop(room, None)

    def close(self) -> None:
        self._service.close()

    def _register(self, frames: list[zmq.Frame]) -> list[bytes]:
        body = frames[-1].bytes
        try:
            message = json.loads(body)
            with self._lock:
                self._destinations[int(message["room"])] = str(message["endpoint"])
        except (ValueError, KeyError, TypeError):
            logger.warning("bootstrap listener: a malformed registration was ignored: %r", body[:200])
        return []


@dataclass
class _Handoff:
    req: Req
    slots: torch.Tensor
    metadata: bytes
    deadline: float
    sending: bool = False


class PrefillHandoff:
    """Holds each prefilled request's KV until its decode worker has it."""

    def __init__(self, args: ServerArgs, pool: KVPool, side: KVSide, registry: PluginRegistry):
        backend = registry.kv_transfer_backend(args.disaggregation_transfer_backend, side)
        self.timeout_s = args.disaggregation_timeout_secs
        self.sender: KVSender = backend.open_sender(pool, side)
        self.listener = BootstrapListener(args.host, args.disaggregation_bootstrap_port)
        self._held: dict[int, _Handoff] = {}
        self._connected: set[str] = set()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, req: Req, token_table: torch.Tensor) -> Req | None:
        """Keep a request whose prompt is computed and whose first token is sampled
        until its KV is handed over (``req.bootstrap`` names its room). A request held
        for the same room already (a client that reused a room) is given back to be
        released: its room is now the new one's."""
        assert req.bootstrap is not None and req.kv is not None
        prompt = len(req.origin_input_ids)
        slots = token_table[req.kv.row, :prompt].clone()
        first = {"token": req.output_ids[0]}
        if req.output_token_logprobs:
            first["logprob"] = req.output_token_logprobs[0][0]  # type: ignore[assignment]
        if req.output_top_logprobs:
            first["top_logprobs"] = req.output_top_logprobs[0]  # type: ignore[assignment]
        metadata = json.dumps(first).encode()
        displaced = self._held.pop(req.bootstrap.room, None)
        if displaced is not None:
            logger.warning("room %d was reused by %s: %s is released", req.bootstrap.room, req.rid, displaced.req.rid)
            if displaced.sending:
                self.sender.forget(req.bootstrap.room)
        self._held[req.bootstrap.room] = _Handoff(req, slots, metadata, time.monotonic() + self.timeout_s)
        return displaced.req if displaced is not None else None

    def poll(self, release: Callable[[Req], None]) -> None:
        """Start the handovers whose destination is known; ``release`` the requests
        whose handover ended (acknowledged, refused or timed out)."""
        for room, handoff in list(self._held.items()):
            reason = self._advance(room, handoff)
            if reason is None and not handoff.sending:
                continue
            if reason is None:
                status = self.sender.poll(room)
                if status.state is TransferState.PENDING:
                    continue
                reason = status.reason if status.state is TransferState.FAILED else None
                self.sender.forget(room)
            if reason:
                logger.warning("request %s: its KV did not reach the decode worker: %s", handoff.req.rid, reason)
            del self._held[room]
            self.listener.forget(room)
            release(handoff.req)

    def _advance(self, room: int, handoff: _Handoff) -> str | None:
        """Start sending once the decode worker has said where; a reason when it never did."""
        if handoff.sending:
            return None
        endpoint = self.listener.destination(room)
        if endpoint is None:
            if time.monotonic() > handoff.deadline:
                return f"no decode worker registered room {room} in {self.timeout_s:g} s"
            return None
        if endpoint not in self._connected:
            try:
                self.sender.connect(endpoint, min(10.0, self.timeout_s))
            except (TransferRefused, TimeoutError) as exc:
                return str(exc)
            self._connected.add(endpoint)
        remaining = max(handoff.deadline - time.monotonic(), 1.0)
        self.sender.send(room, handoff.slots, [endpoint], remaining, handoff.metadata)
        handoff.sending = True
        return None

    def close(self) -> None:
        self.sender.close()
        self.listener.close()


# ---- the decode side ---------------------------------------------------------------------
@dataclass
class _Arrival:
    req: Req
    deadline: float
    room_open: bool = False


@dataclass
class FirstToken:
    """What the prefill worker sent with the KV."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[float, int]] | None = None

    @classmethod
    def of(cls, metadata: bytes) -> FirstToken:
        fields = json.loads(metadata)
        top = fields.get("top_logprobs")
        return cls(
            int(fields["token"]), fields.get("logprob"), [(float(p[0]), int(p[1])) for p in top] if top else None
        )


class DecodeArrivals:
    """Requests waiting for their KV from a prefill worker: their slots preallocated,
    their rooms open on the receiver, the prefill side told where to send."""

    def __init__(self, args: ServerArgs, pool: KVPool, side: KVSide, registry: PluginRegistry):
        backend = registry.kv_transfer_backend(args.disaggregation_transfer_backend, side)
        self.timeout_s = args.disaggregation_timeout_secs
        self.receiver: KVReceiver = backend.open_receiver(pool, side, args.host)
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
        open_room: Callable[[Req], torch.Tensor | None],
        arrived: Callable[[Req, FirstToken], None],
        failed: Callable[[Req, FinishReason], None],
    ) -> None:
        """Open the rooms that ``open_room`` finds KV slots for (None: not yet), then hand
        the requests whose KV has come to ``arrived``, and those whose room failed to
        ``failed``."""
        for arrival in list(self._waiting):
            req = arrival.req
            assert req.bootstrap is not None
            if not arrival.room_open:
                if time.monotonic() > arrival.deadline:
                    self._waiting.remove(arrival)
                    failed(req, transfer_failed(f"no room in the KV pool for {self.timeout_s:g} s"))
                    continue
                slots = open_room(req)
                if slots is None:
                    continue
                try:
                    self.receiver.expect(req.bootstrap.room, slots, max(arrival.deadline - time.monotonic(), 1.0))
                except ValueError as exc:  # a room in use here already
                    self._waiting.remove(arrival)
                    failed(req, FinishReason(type="abort", status_code=400, message=str(exc)))
                    continue
                self._register(req.bootstrap)
                arrival.room_open = True
                continue
            status = self.receiver.poll(req.bootstrap.room)
            if status.state is TransferState.PENDING:
                continue
            self._waiting.remove(arrival)
            if status.state is TransferState.DONE:
                first = FirstToken.of(self.receiver.metadata(req.bootstrap.room))
                self.receiver.forget(req.bootstrap.room)
                arrived(req, first)
            else:
                self.receiver.forget(req.bootstrap.room)
                failed(req, transfer_failed(status.reason))

    def _register(self, bootstrap: Bootstrap) -> None:
        """Tell the prefill worker's bootstrap listener where the room's KV goes."""
        key = (bootstrap.host, bootstrap.port)
        socket = self._bootstraps.get(key)
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(f"tcp://{bootstrap.host}:{bootstrap.port}")
            self._bootstraps[key] = socket
        socket.send(json.dumps({"room": bootstrap.room, "endpoint": self.receiver.endpoint}).encode())

    def _close_room(self, arrival: _Arrival) -> None:
        if arrival.room_open and arrival.req.bootstrap is not None:
            self.receiver.forget(arrival.req.bootstrap.room)

    def close(self) -> None:
        self.receiver.close()
        for socket in self._bootstraps.values():
            socket.close()
