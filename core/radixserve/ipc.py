"""ZMQ plumbing shared by the processes: endpoints, sockets, child-process hygiene."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq

# A socket of the context's kind (zmq.asyncio's in the tokenizer manager, plain zmq's elsewhere).
SocketT = TypeVar("SocketT", bound="zmq.Socket[Any]")


@dataclass(frozen=True)
class Endpoints:
    """IPC addresses: who binds which (the receiver binds)."""

    scheduler: str  # scheduler PULLs requests from the tokenizer manager
    detokenizer: str  # detokenizer PULLs token batches from the scheduler
    tokenizer_manager: str  # tokenizer manager PULLs text batches and control replies
    directory: str  # holds the socket files

    @classmethod
    def fresh(cls) -> Endpoints:
        base = tempfile.mkdtemp(prefix="radixserve-")
        return cls(
            f"ipc://{base}/scheduler", f"ipc://{base}/detokenizer", f"ipc://{base}/tokenizer_manager", directory=base
        )

    def for_replica(self, dp_rank: int) -> Endpoints:
        """Data-parallel replica ``dp_rank``'s addresses behind the DP controller: it
        PULLs requests on its own address, sends token batches to the shared
        detokenizer, and control replies and finish reports to the controller,
        which PULLs where the TokenizerManager sends (``scheduler``)."""
        return Endpoints(
            f"ipc://{self.directory}/scheduler-dp{dp_rank}", self.detokenizer, self.scheduler, self.directory
        )

    def remove(self) -> None:
        """Delete the socket files (after every process using them has stopped)."""
        shutil.rmtree(self.directory, ignore_errors=True)


class RouterService:
    """A ROUTER socket bound at ``address`` (``tcp://host:port``, ``:*`` for any port)
    served by its own thread, which owns it (ZMQ sockets are not thread-safe):
    ``handle(frames)`` gets each message's frames after the sender's identity and
    returns the reply's frames (none: no reply). ``endpoint`` is where it is bound."""

    def __init__(self, address: str, handle: Callable[[list[zmq.Frame]], list[Any]], name: str, poll_ms: int = 20):
        self._handle, self._poll_ms = handle, poll_ms
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(self._poll_ms):
                continue
            sender, *frames = self._socket.recv_multipart(copy=False)
            reply = self._handle(frames)
            if reply:
                self._socket.send_multipart([sender, *reply])


def push_socket(ctx: zmq.Context[SocketT], address: str) -> SocketT:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def pull_socket(ctx: zmq.Context[SocketT], address: str) -> SocketT:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


def die_with_parent() -> None:
    """In a child process: exit when the parent does, so nothing is orphaned."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):  # Linux: the kernel sends SIGTERM when the parent dies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    def watch() -> None:  # portable fallback
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
