"""The tensor-parallel ranks of one scheduler group, joined by torch.distributed.

Every rank connects, as a client, to one ``TCPStore`` (``Rendezvous``): the
launching process hosts it (``host_store``), or a launcher that already runs
one (torchrun's agent) does. A rank then has two groups: the device group, of
the platform's backend (gloo, nccl, hccl), whose collectives the model's layers
use through the platform's ``Communicator``; and a gloo group on the host, which
carries rank 0's decisions (each loop's messages, the dtype, the backends) and
the KV pool's minimum. Both time out after ``RankSpec.timeout_s``, so a rank
that hangs fails its peers' next collective instead of stalling them forever.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist

from radixserve.communicator import Communicator
from radixserve.platform import Platform

if TYPE_CHECKING:
    # Where torch defines them: torch.distributed re-exports them without marking them public.
    from torch._C._distributed_c10d import TCPStore

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Rendezvous:
    """The TCPStore the ranks meet at, and the key prefix this group uses in it."""

    host: str
    port: int
    prefix: str = "radixserve"


@dataclass(frozen=True)
class RankSpec:
    """How one rank joins its group: ``rank`` of ``size``; ``local_rank`` counts
    the ranks on this node (its device is ``--base-gpu-id`` + ``local_rank``)."""

    rank: int
    size: int
    local_rank: int
    rendezvous: Rendezvous
    timeout_s: float


def host_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """Serve the group's TCPStore from this process (``port`` 0: one the OS picks,
    then read ``.port``); keep the object alive while the ranks run."""
    # torch.distributed's public name, not marked exported in its type information:
    return dist.TCPStore(  # type: ignore[attr-defined]
        host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


class TPGroup:
    """This process's place among the tensor-parallel ranks, and their collectives."""

    def __init__(self, rank: int, size: int, local_rank: int, comm: Communicator | None, cpu_group: Any):
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.comm = comm  # None when size is 1
        self._cpu_group = cpu_group

    @classmethod
    def single(cls) -> TPGroup:
        """tp_size 1: no torch.distributed at all."""
        return cls(0, 1, 0, None, None)

    @property
    def is_leader(self) -> bool:
        """Rank 0: receives the requests, decides for the group and sends the outputs."""
        return self.rank == 0

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank (pickled over the host group)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._cpu_group)
        return box[0]

    def min(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._cpu_group)
        return int(t.item())

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order (pickled over the host group)."""
        if self.size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self._cpu_group)
        return gathered

    def min_max(self, values: list[int]) -> tuple[list[int], list[int]]:
        """Each value's smallest and largest over the ranks (one collective)."""
        if self.size == 1 or not values:
            return values, values
        t = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._cpu_group)
        n = len(values)
        return t[:n].tolist(), [-v for v in t[n:].tolist()]

    def destroy(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def join_group(spec: RankSpec | None, platform: Platform) -> TPGroup:
    """Join the group ``spec`` describes (None: a group of one, nothing to join)."""
    if spec is None:
        return TPGroup.single()
    timeout = timedelta(seconds=spec.timeout_s)
    where = f"{spec.rendezvous.host}:{spec.rendezvous.port}"
    logger.info(
        "rank %d of %d joining at %s (%s, timeout %.0f s)",
        spec.rank,
        spec.size,
        where,
        platform.dist_backend,
        spec.timeout_s,
    )
    # torch.distributed's public names, not marked exported in its type information:
    client = dist.TCPStore(  # type: ignore[attr-defined]
        spec.rendezvous.host, spec.rendezvous.port, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(spec.rendezvous.prefix, client)  # type: ignore[attr-defined]
    dist.init_process_group(
        backend=platform.dist_backend, store=store, rank=spec.rank, world_size=spec.size, timeout=timeout
    )
    # The host group is separate even where the device backend is gloo: with overlap
    # scheduling the model's collectives run on the worker thread while the loop broadcasts.
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    world = cast(dist.ProcessGroup, dist.group.WORLD)  # set by init_process_group
    comm = platform.communicator(world, spec.size)
    return TPGroup(spec.rank, spec.size, spec.local_rank, comm, cpu_group)
