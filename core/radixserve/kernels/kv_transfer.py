"""The KV-transfer contract: how the KV a prefill worker computed reaches the pool of
a decode worker (prefill/decode disaggregation). A plugin registers
``KVTransferBackend`` subclasses through ``register_kv_transfer_backends``;
``radixserve.testing.check_kv_transfer_backend`` checks one. ``tcp`` is built in.

Each side describes its KV with a ``KVSide``. A pair is checked once, at the
handshake (``KVSender.connect``), so that what a backend cannot convert is
refused before any request, naming what differs (``pair_reasons``), rather than
failing mid-request.

Addressing is by token slot: the sender reads a request's tokens, in order, from
its own slots; the receiver writes them, in the same order, to the slots it
preallocated. Page sizes and pool layouts (token- or head-major) may therefore
differ between the sides. Heads are numbered in the whole model: a
tensor-parallel rank holds a contiguous range of the model's KV heads, and a
sender gives each receiver the heads both hold (a tp 1 prefill worker and a tp 2
decode worker: one sender, two receivers, each given half of the heads; tp 2 to
tp 1: two senders to one receiver, which is complete once both have sent).

One request's transfer is a *room* (SGLang's ``bootstrap_room``)::

    receiver.expect(room, slots, timeout_s)    decode side: its pages preallocated
    sender.send(room, slots, endpoints, ...)   prefill side: once its forward has run
    sender.poll(room), receiver.poll(room)     each side, at each scheduler step

The sender's room is DONE once the receiver has acknowledged all it sent: the
prefill side frees its copy of the KV only then. The receiver's room is DONE once
every head of every layer of every token it expects has arrived, with the room's
metadata (``receiver.metadata(room)``: the first token and what else the decode
side needs, in the caller's encoding). FAILED carries
the reason; either way each side frees its pages and calls ``forget(room)``.
"""

from __future__ import annotations

import enum
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from radixserve.cache.memory_pool import KVPool


@dataclass(frozen=True)
class KVSide:
    """One side's KV, as the other side and the backend need to know it."""

    device: str  # the platform's name
    dtype: str  # the pool's, as torch names it without the prefix: "bfloat16"
    num_layers: int
    head_dim: int
    total_kv_heads: int  # the model's
    heads: tuple[int, int]  # [start, stop) of the model's KV heads held here
    page_size: int
    head_major: bool = False  # the pool's KVLayout
    latent: bool = False  # MLA's latent KV rather than per-head K and V

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype: {self.dtype!r} is not a torch dtype")
        return dtype

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> KVSide:
        fields = json.loads(data)
        return cls(**{**fields, "heads": tuple(fields["heads"])})


def dtype_name(dtype: torch.dtype) -> str:
    """``KVSide.dtype`` of a torch dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def common_heads(a: KVSide, b: KVSide) -> tuple[int, int] | None:
    """The model's KV heads both sides hold, [start, stop); None when none."""
    start, stop = max(a.heads[0], b.heads[0]), min(a.heads[1], b.heads[1])
    return (start, stop) if start < stop else None


def pair_reasons(sender: KVSide, receiver: KVSide) -> list[str]:
    """Why KV cannot go from ``sender`` to ``receiver`` whatever the backend: they
    must hold the same model's KV in the same dtype, and share a head."""
    reasons = []
    for name in ("dtype", "num_layers", "head_dim", "total_kv_heads", "latent"):
        mine, theirs = getattr(sender, name), getattr(receiver, name)
        if mine != theirs:
            reasons.append(f"{name}: the prefill side has {mine}, the decode side {theirs}")
    if not reasons and common_heads(sender, receiver) is None:
        reasons.append(
            f"heads: no KV head in common (the prefill side holds {list(sender.heads)}, "
            f"the decode side {list(receiver.heads)})"
        )
    return reasons


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferStatus:
    state: TransferState
    reason: str = ""  # why it failed

    @property
    def finished(self) -> bool:
        return self.state is not TransferState.PENDING


PENDING = TransferStatus(TransferState.PENDING)
DONE = TransferStatus(TransferState.DONE)


class TransferRefused(Exception):
    """The other side refused the pair at the handshake."""

    def __init__(self, endpoint: str, reasons: list[str]):
        super().__init__(f"the KV receiver at {endpoint} refused the pair: " + "; ".join(reasons))
        self.endpoint, self.reasons = endpoint, reasons


class KVReceiver(ABC):
    """The decode side's end: writes what senders send into its pool."""

    endpoint: str  # where senders reach it (what the bootstrap server hands out)

    @abstractmethod
    def expect(self, room: int, slots: torch.Tensor, timeout_s: float) -> None:
        """Accept ``room``'s KV into ``slots`` (one per token, in order), preallocated;
        the room fails if it is not whole within ``timeout_s``."""

    @abstractmethod
    def poll(self, room: int) -> TransferStatus: ...

    @abstractmethod
    def metadata(self, room: int) -> bytes:
        """What the sender sent with the KV of a DONE room (the first token, its
        logprobs, the sampling state: the caller's encoding); ValueError before."""

    @abstractmethod
    def forget(self, room: int) -> None:
        """Drop the room's state (after DONE or FAILED, or to give up on it)."""

    @abstractmethod
    def close(self) -> None: ...


class KVSender(ABC):
    """The prefill side's end: reads a request's KV from its pool and sends it."""

    @abstractmethod
    def connect(self, endpoint: str, timeout_s: float) -> KVSide:
        """Handshake with the receiver at ``endpoint``: its side, or TransferRefused
        with every reason; TimeoutError when it does not answer."""

    @abstractmethod
    def send(
        self, room: int, slots: torch.Tensor, endpoints: Sequence[str], timeout_s: float, metadata: bytes = b""
    ) -> None:
        """Start sending ``room``'s KV, read from ``slots`` (one per token, in order), and
        ``metadata`` to the receivers at ``endpoints``, each connected already and given
        the heads it holds (a tp 2 decode worker: its two ranks); the room is DONE once
        every one acknowledged it, FAILED if one refused it or not all did within
        ``timeout_s``. The slots must stay allocated until the room is finished. Every
        sender of a room sends the same metadata (tensor-parallel ranks sample alike)."""

    @abstractmethod
    def poll(self, room: int) -> TransferStatus: ...

    @abstractmethod
    def forget(self, room: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class KVTransferBackend(ABC):
    """A way to move KV between workers (``--disaggregation-transfer-backend NAME``).

    ``unsupported_reasons`` says why it cannot serve a side here (cheap, no
    side effects: a missing library, a device it cannot read); ``pair_reasons``
    what it refuses between two sides (the common ``pair_reasons`` at least)."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0

    @classmethod
    def unsupported_reasons(cls, side: KVSide) -> list[str]:
        return []

    @classmethod
    def pair_reasons(cls, sender: KVSide, receiver: KVSide) -> list[str]:
        return pair_reasons(sender, receiver)

    @classmethod
    @abstractmethod
    def open_receiver(cls, pool: KVPool, side: KVSide, host: str) -> KVReceiver:
        """A receiver writing into ``pool``, reachable at ``host``."""

    @classmethod
    @abstractmethod
    def open_sender(cls, pool: KVPool, side: KVSide) -> KVSender:
        """A sender reading from ``pool``."""
