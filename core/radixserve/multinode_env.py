"""Where this node stands among several when a launcher started it: torchrun, or
a Kubernetes LeaderWorkerSet whose pod spec sets the same variables.

Read (only when none of --nnodes, --node-rank, --dist-init-addr is given):

- ``MASTER_ADDR``, ``MASTER_PORT`` -> ``--dist-init-addr MASTER_ADDR:MASTER_PORT``
- ``WORLD_SIZE`` -> ``--nnodes`` (one radixserve process per node)
- ``RANK`` -> ``--node-rank``
- ``LOCAL_WORLD_SIZE`` must be 1 or unset: radixserve starts a node's ranks itself
- ``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun sets it): torchrun's agent
  already serves a TCP store at MASTER_ADDR:MASTER_PORT, so the ranks use that
  one (under their own key prefix) instead of node 0 serving one there.

``LOCAL_RANK`` and ``GROUP_RANK`` are not needed (they are 0 and ``RANK`` with one
process per node).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from radixserve.config import ServerArgs

PLACEMENT_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
ONE_PER_NODE_HINT = (
    "radixserve starts a node's tp_size / nnodes ranks itself: launch one radixserve process per node "
    "(torchrun --nproc-per-node 1)"
)


@dataclass(frozen=True)
class LauncherPlacement:
    nnodes: int
    node_rank: int
    dist_init_addr: str

    def describe(self) -> str:
        return (
            f"--nnodes {self.nnodes} --node-rank {self.node_rank} --dist-init-addr {self.dist_init_addr} "
            f"(from WORLD_SIZE, RANK, MASTER_ADDR:MASTER_PORT)"
        )


def placement_from_env(environ: Mapping[str, str]) -> LauncherPlacement | None:
    """The placement the launcher's variables give, or None where none is set.
    ValueError (naming the variable) for a partial or inconsistent set."""
    present = [name for name in PLACEMENT_VARS if name in environ]
    if not present:
        return None
    missing = [name for name in PLACEMENT_VARS if name not in environ]
    if missing:
        raise ValueError(f"{', '.join(missing)}: unset while {', '.join(present)} are set (a launcher sets all four)")
    if environ.get("LOCAL_WORLD_SIZE", "1") != "1":
        raise ValueError(f"LOCAL_WORLD_SIZE: is {environ['LOCAL_WORLD_SIZE']}; {ONE_PER_NODE_HINT}")
    numbers = {}
    for name in ("MASTER_PORT", "WORLD_SIZE", "RANK"):
        value = environ[name]
        if not value.isdigit():
            raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
        numbers[name] = int(value)
    host = environ["MASTER_ADDR"]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    return LauncherPlacement(numbers["WORLD_SIZE"], numbers["RANK"], f"{host}:{numbers['MASTER_PORT']}")


def launcher_serves_store(args: ServerArgs, environ: Mapping[str, str]) -> bool:
    """torchrun's agent already serves the TCP store at ``--dist-init-addr``
    (MASTER_ADDR:MASTER_PORT, where ``TORCHELASTIC_USE_AGENT_STORE`` is True)."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    placement = placement_from_env(environ)
    return placement is not None and placement.dist_init_addr == args.dist_init_addr


def apply_launcher_env(args: ServerArgs, environ: Mapping[str, str]) -> tuple[ServerArgs, LauncherPlacement | None]:
    """``args`` with the launcher's placement filled in, and that placement; the
    flags win: with any of them given, the environment is not read."""
    if args.nnodes != 1 or args.node_rank != 0 or args.dist_init_addr is not None:
        return args, None
    placement = placement_from_env(environ)
    if placement is None:
        return args, None
    placed = dataclasses.replace(
        args, nnodes=placement.nnodes, node_rank=placement.node_rank, dist_init_addr=placement.dist_init_addr
    )
    return placed, placement
