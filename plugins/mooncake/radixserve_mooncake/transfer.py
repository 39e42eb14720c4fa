"""``mooncake``: KV transfer by Mooncake's transfer engine, one-sided writes from the
prefill worker's pool straight into the decode worker's (RDMA between GPUs' memory,
or its TCP transport where there is no RDMA NIC).

The handshake, rooms, acknowledgements and timeouts are the built-in ``tcp``
backend's (ZMQ): at the handshake the receiver hands over its engine's session and
the addresses of its pool's buffers (``data_plane``); a sender then writes a room's
KV with one batch of the engine's writes and sends the ``end`` that says how much it
wrote. Each side registers its pool's buffers with its engine once, when it opens.

A write is a run of bytes contiguous on both sides: the units (one token's one head
of one layer's K or V) are laid out in the receiver's order and neighbours that are
neighbours on both sides merge, so a pair with the same layout and heads moves whole
pages at a time, and one that differs (page size, token- or head-major, a tensor-
parallel split of the heads) still moves exactly the bytes each slot needs.

Environment: ``RADIXSERVE_MOONCAKE_PROTOCOL`` (``tcp``, the default, or ``rdma``),
``RADIXSERVE_MOONCAKE_DEVICE`` (the RDMA NICs, e.g. ``mlx5_0,mlx5_1``; empty:
Mooncake picks), ``RADIXSERVE_MOONCAKE_HOST`` (the address the prefill side's
engine listens on; this machine's by default).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.cache.memory_pool import KVPool
from radixserve.disaggregation.tcp_transfer import Connection, TcpReceiver, TcpSender
from radixserve.kernels.kv_transfer import KVReceiver, KVSender, KVSide, KVTransferBackend, common_heads

logger = logging.getLogger(__name__)

# Mooncake's wheels: the CUDA build (reads GPU memory; needs the NVIDIA driver's libcuda)
# and the build without CUDA (host memory only). Both install the package ``mooncake``.
CUDA_DISTRIBUTION = "mooncake-transfer-engine"
HOST_DISTRIBUTION = "mooncake-transfer-engine-non-cuda"


def _load_engine_class() -> Any:
    # Mooncake logs each new connection at glog's INFO level; its warnings and errors stay.
    os.environ.setdefault("GLOG_minloglevel", "1")
    from mooncake.engine import TransferEngine

    return TransferEngine


def load_problem() -> str | None:
    """Why Mooncake's engine cannot be used here (None when it can): not installed, or
    its shared library does not load (a missing libcuda.so.1 or libibverbs.so.1)."""
    try:
        _load_engine_class()
    except ImportError as exc:
        if exc.name in ("mooncake", "mooncake.engine"):
            return (
                f"Mooncake's transfer engine is not installed: pip install "
                f"'radixserve-plugin-mooncake[cuda]' ({CUDA_DISTRIBUTION}) on a machine with the "
                f"NVIDIA driver, '[cpu]' ({HOST_DISTRIBUTION}) elsewhere"
            )
        return (
            f"Mooncake's transfer engine does not load: {exc} (it needs libibverbs.so.1, Debian's libibverbs1; "
            f"its CUDA build also the NVIDIA driver's libcuda.so.1)"
        )
    return None


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


_engines: dict[str, Any] = {}  # by host: one per process, as Mooncake means it (threads, ports)
_engines_lock = threading.Lock()


def _engine_on(host: str) -> Any:
    with _engines_lock:
        engine = _engines.get(host)
        if engine is None:
            protocol = os.environ.get("RADIXSERVE_MOONCAKE_PROTOCOL", "tcp")
            engine = _load_engine_class()()
            nics = os.environ.get("RADIXSERVE_MOONCAKE_DEVICE", "")
            code = engine.initialize(host, "P2PHANDSHAKE", protocol, nics)
            if code != 0:
                raise RuntimeError(
                    f"Mooncake's transfer engine did not start on {host} with protocol {protocol!r} (code {code}); "
                    "RADIXSERVE_MOONCAKE_PROTOCOL=rdma needs an RDMA NIC (RADIXSERVE_MOONCAKE_DEVICE names it)"
                )
            logger.info("mooncake: %s transport on %s:%d", protocol, host, engine.get_rpc_port())
            _engines[host] = engine
        return engine


@dataclass
class _RegisteredPool:
    """A pool's buffers registered with the engine on ``host``."""

    engine: Any
    session: str  # host:port, where other engines reach this one
    k_bases: list[int]  # each layer's K buffer's address
    v_bases: list[int]

    @classmethod
    def register(cls, host: str, pool: KVPool) -> _RegisteredPool:
        engine = _engine_on(host)
        k_bases = [buffer.data_ptr() for buffer in pool.k_buffers]
        v_bases = [buffer.data_ptr() for buffer in pool.v_buffers]
        sizes = [buffer.numel() * buffer.element_size() for buffer in (*pool.k_buffers, *pool.v_buffers)]
        code = engine.batch_register_memory([*k_bases, *v_bases], sizes)
        if code != 0:
            raise RuntimeError(f"Mooncake's transfer engine could not register the KV pool's memory (code {code})")
        return cls(engine, f"{host}:{engine.get_rpc_port()}", k_bases, v_bases)

    def unregister(self) -> None:
        self.engine.batch_unregister_memory([*self.k_bases, *self.v_bases])


class MooncakeTransfer(KVTransferBackend):
    name = "mooncake"

    @classmethod
    def unsupported_reasons(cls, side: KVSide) -> list[str]:
        problem = load_problem()
        if problem is not None:
            return [problem]
        if side.latent:
            return ["latent KV (MLA) is not transferred by mooncake yet"]
        if side.device != "cpu" and not _installed(CUDA_DISTRIBUTION):
            return [f"{HOST_DISTRIBUTION} reads host memory only; the KV is on {side.device!r} ({CUDA_DISTRIBUTION})"]
        return []

    @classmethod
    def open_receiver(cls, pool: KVPool, side: KVSide, host: str) -> KVReceiver:
        return MooncakeReceiver(pool, side, host, cls.pair_reasons)

    @classmethod
    def open_sender(cls, pool: KVPool, side: KVSide) -> KVSender:
        return MooncakeSender(pool, side)


class MooncakeReceiver(TcpReceiver):
    """tcp's receiver, whose pool the senders' engines write into."""

    def __init__(self, pool: KVPool, side: KVSide, host: str, pair_reasons: Any):
        self._memory = _RegisteredPool.register(host, pool)
        super().__init__(pool, side, host, pair_reasons)

    def data_plane(self) -> bytes:
        memory = self._memory
        return json.dumps({"session": memory.session, "k": memory.k_bases, "v": memory.v_bases}).encode()

    def close(self) -> None:
        super().close()
        self._memory.unregister()


@dataclass(frozen=True)
class Runs:
    """Byte runs contiguous on both sides, relative to a layer's K (or V) buffer."""

    source: torch.Tensor  # int64 [runs]
    target: torch.Tensor  # int64 [runs]
    lengths: list[int]


def unit_offsets(side: KVSide, slots: torch.Tensor, heads: tuple[int, int], receiver_order: KVSide) -> torch.Tensor:
    """The byte offsets in ``side``'s layer buffer of each unit (a token's one head):
    the tokens at ``slots`` and the model's ``heads``, in the order the receiver's
    layout keeps them (token-major: token by token; head-major: head by head)."""
    row = side.head_dim * side.torch_dtype.itemsize
    slot = slots.to(torch.int64)[:, None]  # [tokens, 1]
    head = torch.arange(heads[0] - side.heads[0], heads[1] - side.heads[0], dtype=torch.int64)[None, :]
    if side.head_major:  # [pages, heads, page_size, head_dim]
        units = (slot // side.page_size * side.num_heads + head) * side.page_size + slot % side.page_size
    else:  # [slots, heads, head_dim]
        units = slot * side.num_heads + head
    order = units.t() if receiver_order.head_major else units
    return order.reshape(-1) * row


def merge_runs(source: torch.Tensor, target: torch.Tensor, unit_bytes: int) -> Runs:
    """Merges units that follow each other on both sides into one run each."""
    breaks = torch.ones(len(source), dtype=torch.bool)
    breaks[1:] = (source[1:] != source[:-1] + unit_bytes) | (target[1:] != target[:-1] + unit_bytes)
    starts = breaks.nonzero().squeeze(1)
    counts = torch.diff(starts, append=torch.tensor([len(source)]))
    return Runs(source[starts], target[starts], (counts * unit_bytes).tolist())


class MooncakeSender(TcpSender):
    """tcp's sender, which writes each room's KV into the receiver's pool by Mooncake."""

    one_sided = True

    def __init__(self, pool: KVPool, side: KVSide):
        host = os.environ.get("RADIXSERVE_MOONCAKE_HOST") or socket.gethostbyname(socket.gethostname())
        self._memory = _RegisteredPool.register(host, pool)
        super().__init__(pool, side)

    def write_kv(self, connection: Connection, slots: torch.Tensor, their_slots: torch.Tensor) -> int:
        receiver = connection.receiver
        assert receiver is not None
        heads = common_heads(self.side, receiver)
        assert heads is not None  # the handshake refused pairs without one
        target = json.loads(connection.data_plane)
        runs = merge_runs(
            unit_offsets(self.side, slots.cpu(), heads, receiver),
            unit_offsets(receiver, their_slots, heads, receiver),
            self.side.head_dim * self.side.torch_dtype.itemsize,
        )
        sources, targets, lengths = [], [], []
        for layer in range(self.side.num_layers):
            for mine, theirs in ((self._memory.k_bases, target["k"]), (self._memory.v_bases, target["v"])):
                sources += (runs.source + mine[layer]).tolist()
                targets += (runs.target + theirs[layer]).tolist()
                lengths += runs.lengths
        code = self._memory.engine.batch_transfer_sync_write(target["session"], sources, targets, lengths)
        if code != 0:
            raise ConnectionError(f"Mooncake's write to {target['session']} failed (code {code})")
        return self.side.num_layers * len(slots) * (heads[1] - heads[0])

    def close(self) -> None:
        super().close()
        self._memory.unregister()
