"""``tcp``: the built-in KV-transfer backend, over ZMQ on TCP. It works between any
two machines that can reach each other, on any device whose tensors torch can copy
to the host; it is not the fastest (the KV goes through host memory and the kernel's
TCP stack on both sides: an RDMA backend such as Mooncake's writes device memory
directly).

Each end runs one thread that owns its sockets (ZMQ sockets are not thread-safe),
so neither scheduler waits on the network:

- the receiver binds a ROUTER socket. To a ``hello`` (the sender's ``KVSide``) it
  answers ``welcome`` (its own, and its ``data_plane``) or ``refused`` (the
  reasons); a ``kv`` message (one layer of a room: a header, then K's and V's
  bytes) it writes into its pool at the room's slots; to an ``end`` (a sender has
  sent all of a room, and the room's metadata) it answers ``ack``, or ``nack``
  with a reason when the room is not expected or has failed.
- the sender keeps one DEALER socket per receiver. ``send`` queues the room; the
  thread reads each layer's K and V from the pool (the heads the receiver holds),
  sends them and the ``end``, and marks the room DONE at the ``ack``.

A connection's messages arrive in order, so by a sender's ``end`` the receiver has
written all that sender sent.

The two classes are public for transfer plugins: a backend that moves the KV
itself (one-sided writes into the receiver's memory, as Mooncake's transfer engine
does) keeps this handshake, the rooms, acknowledgements and timeouts. Its receiver
overrides ``TcpReceiver.data_plane`` (what a sender needs to reach its memory,
handed over in the ``welcome``); its sender sets ``TcpSender.one_sided`` and
overrides ``write_kv``. Such a sender asks for each room's slots (``where``; the
receiver answers ``slots``, or ``nack`` when it does not expect the room), writes
the KV there, and its ``end`` tells the receiver how many head-token-layers it
wrote.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import zmq

from radixserve.cache.memory_pool import KVPool
from radixserve.ipc import RouterService
from radixserve.kernels.kv_transfer import (
    DONE,
    PENDING,
    KVReceiver,
    KVSender,
    KVSide,
    KVTransferBackend,
    TransferRefused,
    TransferState,
    TransferStatus,
    common_heads,
)

logger = logging.getLogger(__name__)

_POLL_MS = 20  # how long a thread waits for a message before it looks at its clocks again


def _failed(reason: str) -> TransferStatus:
    return TransferStatus(TransferState.FAILED, reason)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes, without a copy (any dtype: bfloat16 has no numpy type)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]


def _reachable(endpoint: str) -> str:
    """A bound endpoint as another machine reaches it: a wildcard address (bound on every
    interface) is replaced by this machine's own."""
    address, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if address.strip("[]") in ("0.0.0.0", "::", "*"):
        address = socket.gethostbyname(socket.gethostname())
    return f"tcp://{address}:{port}"


def _tensor_of(frame: zmq.Frame, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A received frame's bytes as a tensor (copied once: torch wants a writable buffer)."""
    return torch.frombuffer(bytearray(frame.buffer), dtype=torch.uint8).view(dtype).view(shape)


class TcpTransfer(KVTransferBackend):
    name = "tcp"
    priority = 0

    @classmethod
    def unsupported_reasons(cls, side: KVSide) -> list[str]:
        if side.latent:
            return ["latent KV (MLA) is not transferred by tcp yet"]
        return []

    @classmethod
    def open_receiver(cls, pool: KVPool, side: KVSide, host: str) -> KVReceiver:
        return TcpReceiver(pool, side, host, cls.pair_reasons)

    @classmethod
    def open_sender(cls, pool: KVPool, side: KVSide) -> KVSender:
        return TcpSender(pool, side)


# ---- the decode side ---------------------------------------------------------------------
@dataclass
class _ExpectedRoom:
    slots: torch.Tensor
    deadline: float
    units_needed: int  # layers x heads x tokens
    units: int = 0
    metadata: bytes | None = None  # from the first sender's end
    status: TransferStatus = PENDING

    def settle(self) -> None:
        """DONE once every unit and the metadata have come."""
        if self.status is PENDING and self.units >= self.units_needed and self.metadata is not None:
            self.status = DONE


class TcpReceiver(KVReceiver):
    def __init__(self, pool: KVPool, side: KVSide, host: str, pair_reasons: Callable[[KVSide, KVSide], list[str]]):
        self.pool, self.side, self.pair_reasons = pool, side, pair_reasons
        self._dtype = side.torch_dtype
        self._rooms: dict[int, _ExpectedRoom] = {}
        self._lock = threading.Lock()
        self._service = RouterService(f"tcp://{host}:*", self._handle_safely, "kv-receiver", _POLL_MS)
        self.endpoint = _reachable(self._service.endpoint)

    def expect(self, room: int, slots: torch.Tensor, timeout_s: float) -> None:
        units = self.side.num_layers * self.side.num_heads * len(slots)
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"bootstrap_room: room {room} is already expected here")
            self._rooms[room] = _ExpectedRoom(slots.to(self.pool.device), time.monotonic() + timeout_s, units)

    def poll(self, room: int) -> TransferStatus:
        with self._lock:
            expected = self._rooms.get(room)
            if expected is None:
                return _failed(f"room {room} is not expected here")
            if expected.status is PENDING and time.monotonic() > expected.deadline:
                got = f"{expected.units} of {expected.units_needed} head-token-layers"
                expected.status = _failed(f"the KV did not arrive in time ({got})")
            return expected.status

    def metadata(self, room: int) -> bytes:
        with self._lock:
            expected = self._rooms.get(room)
            if expected is None or expected.status is not DONE:
                raise ValueError(f"bootstrap_room: room {room} has not arrived here")
            assert expected.metadata is not None
            return expected.metadata

    def forget(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def close(self) -> None:
        self._service.close()

    def data_plane(self) -> bytes:
        """What a sender needs to write into this pool itself, handed over at the
        handshake (one-sided backends); nothing here: the KV comes in messages."""
        return b""

    def _handle_safely(self, frames: list[zmq.Frame]) -> list[bytes]:
        kind, rest = frames[0].bytes, frames[1:]
        try:
            return self._handle(kind, rest)
        except Exception as exc:  # a malformed message must not stop the receiver
            logger.exception("KV receiver: a %r message failed", kind)
            return [b"error", json.dumps({"reason": f"{type(exc).__name__}: {exc}"}).encode()]

    def _handle(self, kind: bytes, rest: list[zmq.Frame]) -> list[bytes]:
        if kind == b"hello":
            reasons = self.pair_reasons(KVSide.from_json(rest[0].bytes), self.side)
            if reasons:
                return [b"refused", json.dumps(reasons).encode()]
            return [b"welcome", self.side.to_json(), self.data_plane()]
        header = json.loads(rest[0].bytes)
        room = header["room"]
        if kind == b"kv":
            self._write(header, rest[1], rest[2])
            return []
        if kind == b"end":
            with self._lock:
                expected = self._rooms.get(room)
                if expected is not None and not expected.status.finished:
                    expected.units += header["written"]
                    if expected.metadata is None:
                        expected.metadata = rest[1].bytes
                    expected.settle()
            status = self.poll(room)
            if status.state is TransferState.FAILED:
                return [b"nack", json.dumps({"room": room, "reason": status.reason}).encode()]
            return [b"ack", json.dumps({"room": room}).encode()]
        if kind == b"where":
            status = self.poll(room)
            with self._lock:
                expected = self._rooms.get(room)
            if expected is None or status.state is TransferState.FAILED:
                return [b"nack", json.dumps({"room": room, "reason": status.reason}).encode()]
            slots = expected.slots.to(torch.int64).cpu().numpy().tobytes()
            return [b"slots", json.dumps({"room": room}).encode(), slots]
        raise ValueError(f"unknown message kind {kind!r}")

    def _write(self, header: dict[str, Any], k_frame: zmq.Frame, v_frame: zmq.Frame) -> None:
        room, first, count = header["room"], header["first"], header["count"]
        start, stop = header["heads"]
        with self._lock:
            expected = self._rooms.get(room)
            if expected is None or expected.status.finished:
                return  # the "end" that follows answers nack
            slots = expected.slots[first : first + count]
        shape = (count, stop - start, self.side.head_dim)
        k, v = (_tensor_of(frame, self._dtype, shape) for frame in (k_frame, v_frame))
        self.pool.write_kv(
            header["layer"], slots, k.to(self.pool.device), v.to(self.pool.device), start - self.side.heads[0]
        )
        with self._lock:
            expected.units += count * (stop - start)
            expected.settle()


# ---- the prefill side --------------------------------------------------------------------
@dataclass
class _Outgoing:
    room: int
    slots: torch.Tensor
    endpoints: tuple[str, ...]
    deadline: float
    metadata: bytes
    status: TransferStatus = PENDING
    acked: set[str] = field(default_factory=set)  # the endpoints that have all of it


@dataclass
class Connection:
    """A sender's connection to one receiver."""

    socket: zmq.Socket[Any]
    receiver: KVSide | None = None  # once welcomed
    data_plane: bytes = b""  # the receiver's, from its welcome
    hello: Future[KVSide] | None = None  # the connect() waiting for the handshake


class TcpSender(KVSender):
    # True for a backend that writes the KV into the receiver's pool itself (write_kv).
    one_sided: ClassVar[bool] = False

    def __init__(self, pool: KVPool, side: KVSide):
        self.pool, self.side = pool, side
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._connections: dict[str, Connection] = {}  # the thread's alone
        self._rooms: dict[int, _Outgoing] = {}
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # A byte down this pipe wakes the thread from its poll when a job is queued.
        self._wake_read, self._wake_write = os.pipe()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def connect(self, endpoint: str, timeout_s: float) -> KVSide:
        answer: Future[KVSide] = Future()
        self._queue("connect", (endpoint, answer))
        try:
            return answer.result(timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"the KV receiver at {endpoint} did not answer in {timeout_s:g} s") from None

    def send(
        self, room: int, slots: torch.Tensor, endpoints: Sequence[str], timeout_s: float, metadata: bytes = b""
    ) -> None:
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"bootstrap_room: room {room} is already being sent")
            self._rooms[room] = _Outgoing(room, slots, tuple(endpoints), time.monotonic() + timeout_s, metadata)
        self._queue("send", room)

    def poll(self, room: int) -> TransferStatus:
        with self._lock:
            outgoing = self._rooms.get(room)
            if outgoing is None:
                return _failed(f"room {room} is not being sent")
            if outgoing.status is PENDING and time.monotonic() > outgoing.deadline:
                missing = ", ".join(sorted(set(outgoing.endpoints) - outgoing.acked))
                outgoing.status = _failed(f"no acknowledgement from {missing} in time")
            return outgoing.status

    def forget(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def close(self) -> None:
        self._stop.set()
        os.write(self._wake_write, b"x")
        self._thread.join(5)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _queue(self, kind: str, job: Any) -> None:
        self._jobs.put((kind, job))
        os.write(self._wake_write, b"x")

    # ---- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self._take_jobs(poller)
                for sock, _ in poller.poll(_POLL_MS):
                    if sock == self._wake_read:
                        os.read(self._wake_read, 4096)
                    else:
                        self._on_reply(sock)
        finally:
            for connection in self._connections.values():
                connection.socket.close(linger=0)

    def _take_jobs(self, poller: zmq.Poller) -> None:
        while True:
            try:
                kind, job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if kind == "connect":
                endpoint, answer = job
                self._hello(poller, endpoint, answer)
            else:
                self._send_room(job)

    def _hello(self, poller: zmq.Poller, endpoint: str, answer: Future[KVSide]) -> None:
        connection = self._connections.get(endpoint)
        if connection is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(endpoint)
            poller.register(socket, zmq.POLLIN)
            connection = self._connections[endpoint] = Connection(socket)
        if connection.receiver is not None:
            answer.set_result(connection.receiver)
            return
        connection.hello = answer
        connection.socket.send_multipart([b"hello", self.side.to_json()])

    def _send_room(self, room: int) -> None:
        with self._lock:
            outgoing = self._rooms.get(room)
        if outgoing is None or outgoing.status.finished:
            return
        slots = outgoing.slots.to(self.pool.device)
        for endpoint in outgoing.endpoints:
            connection = self._connections.get(endpoint)
            if connection is None or connection.receiver is None:
                self._finish(room, _failed(f"not connected to {endpoint}: connect() first"))
                return
            try:
                self._send_to(connection, room, slots, outgoing.metadata)
            except (zmq.ZMQError, OSError) as exc:
                self._finish(room, _failed(f"sending to {endpoint} failed: {exc}"))
                return

    def _send_to(self, connection: Connection, room: int, slots: torch.Tensor, metadata: bytes) -> None:
        """The room's KV, then its end with the metadata; a one-sided sender first asks
        where the KV goes (the rest follows the receiver's ``slots``)."""
        if self.one_sided:
            connection.socket.send_multipart([b"where", json.dumps({"room": room}).encode()])
            return
        self._send_messages(connection, room, slots)
        self._end(connection, room, metadata, written=0)

    def _end(self, connection: Connection, room: int, metadata: bytes, written: int) -> None:
        end = json.dumps({"room": room, "written": written}).encode()
        connection.socket.send_multipart([b"end", end, metadata])

    def write_kv(self, connection: Connection, slots: torch.Tensor, their_slots: torch.Tensor) -> int:
        """A one-sided sender's write of the KV at ``slots`` (the heads both sides hold)
        into a welcomed receiver's pool at ``their_slots``: the head-token-layers
        written. Runs on the sender's thread; raises OSError when the write fails."""
        raise NotImplementedError(f"{type(self).__name__} is one-sided but does not write the KV")

    def _send_messages(self, connection: Connection, room: int, slots: torch.Tensor) -> None:
        """Each layer's K and V of the heads both sides hold, in a message the receiver writes."""
        assert connection.receiver is not None
        heads = common_heads(self.side, connection.receiver)
        assert heads is not None  # the handshake refused pairs without one
        local = (heads[0] - self.side.heads[0], heads[1] - self.side.heads[0])
        header = {"room": room, "first": 0, "count": len(slots), "heads": list(heads)}
        for layer in range(self.side.num_layers):
            k, v = self.pool.read_kv(layer, slots, local)
            head = json.dumps({**header, "layer": layer}).encode()
            connection.socket.send_multipart([b"kv", head, _bytes_of(k.cpu()), _bytes_of(v.cpu())], copy=False)

    def _on_reply(self, sock: zmq.Socket[Any]) -> None:
        kind, body, *data = sock.recv_multipart()
        endpoint = next(e for e, c in self._connections.items() if c.socket is sock)
        connection = self._connections[endpoint]
        if kind in (b"welcome", b"refused"):
            answer, connection.hello = connection.hello, None
            if kind == b"welcome":
                connection.receiver = KVSide.from_json(body)
                connection.data_plane = data[0]
                if answer is not None:
                    answer.set_result(connection.receiver)
            elif answer is not None:
                answer.set_exception(TransferRefused(endpoint, json.loads(body)))
            return
        reply = json.loads(body)
        if kind == b"ack":
            self._acked(reply["room"], endpoint)
        elif kind == b"slots":
            self._write_room(connection, endpoint, reply["room"], data[0])
        elif kind == b"nack":
            self._finish(reply["room"], _failed(f"the receiver at {endpoint} refused the KV: {reply['reason']}"))
        else:
            logger.error("KV receiver at %s: %s", endpoint, reply.get("reason", reply))

    def _write_room(self, connection: Connection, endpoint: str, room: int, their_slots: bytes) -> None:
        """A one-sided sender's answer to ``slots``: the write, then the room's end."""
        with self._lock:
            outgoing = self._rooms.get(room)
        if outgoing is None or outgoing.status.finished:
            return
        try:
            slots = torch.frombuffer(bytearray(their_slots), dtype=torch.int64)
            written = self.write_kv(connection, outgoing.slots, slots)
            self._end(connection, room, outgoing.metadata, written)
        except (zmq.ZMQError, OSError) as exc:
            self._finish(room, _failed(f"writing to {endpoint} failed: {exc}"))

    def _acked(self, room: int, endpoint: str) -> None:
        with self._lock:
            outgoing = self._rooms.get(room)
            if outgoing is None or outgoing.status.finished:
                return
            outgoing.acked.add(endpoint)
            if outgoing.acked >= set(outgoing.endpoints):
                outgoing.status = DONE

    def _finish(self, room: int, status: TransferStatus) -> None:
        with self._lock:
            outgoing = self._rooms.get(room)
            if outgoing is not None and not outgoing.status.finished:
                outgoing.status = status
