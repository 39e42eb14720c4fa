"""Where the model process runs on the host: its NUMA node, CPUs, threads and memory.

A decode step streams every weight from memory, so the model process keeps to
one NUMA node, where its memory is local: of the CPUs it may run on
(``os.sched_getaffinity``), those of the node holding most of them, with one
torch thread per physical core there (hyperthread siblings share a core's
vector units; torch's own default is one thread per physical core too). The KV
pool is sized from that node's memory, or the machine's where there is one
node, within the process's cgroup memory limit. All of it is read from
``/sys`` and ``/proc``; the paths are parameters so tests can pass a fake tree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

SYSFS = Path("/sys/devices/system")
PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")
# A cgroup v1 memory limit at or above this is "no limit" (the kernel reports about 2**63).
_NO_CGROUP_LIMIT = 1 << 60


def parse_cpulist(text: str) -> frozenset[int]:
    """The kernel's cpulist format: ``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def numa_nodes(sysfs: Path = SYSFS) -> dict[int, frozenset[int]]:
    """Each NUMA node's CPUs; empty where the kernel shows no nodes."""
    nodes = {}
    for path in sorted((sysfs / "node").glob("node[0-9]*")):
        try:
            nodes[int(path.name.removeprefix("node"))] = parse_cpulist((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def choose_node(allowed: frozenset[int], nodes: dict[int, frozenset[int]]) -> tuple[int | None, frozenset[int]]:
    """The node holding most of the ``allowed`` CPUs (the lowest on a tie) and those
    CPUs; (None, allowed) where no node holds any."""
    best = max(sorted(nodes), key=lambda n: len(nodes[n] & allowed), default=None)
    if best is None or not nodes[best] & allowed:
        return None, allowed
    return best, nodes[best] & allowed


def physical_cores(cpus: frozenset[int], sysfs: Path = SYSFS) -> int:
    """How many physical cores ``cpus`` are on (hyperthread siblings count once)."""
    cores = set()
    for cpu in cpus:
        try:
            cores.add(parse_cpulist((sysfs / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()))
        except (OSError, ValueError):
            cores.add(frozenset({cpu}))
    return len(cores)


@dataclass(frozen=True)
class CpuPlacement:
    """Where the model process runs (the startup summary shows it)."""

    node: int | None  # its NUMA node; None where the kernel shows none
    num_nodes: int  # NUMA nodes on the machine (0: none shown)
    cpus: frozenset[int]  # the CPUs it runs on
    cores: int  # physical cores among them
    threads: int  # torch intra-op threads
    threads_from: str  # how the thread count was chosen

    def describe(self) -> str:
        where = f"NUMA node {self.node} of {self.num_nodes}" if self.node is not None else "no NUMA nodes shown"
        return (
            f"{where}: CPUs {format_cpulist(self.cpus)}, {self.cores} physical cores, "
            f"{self.threads} torch threads ({self.threads_from})"
        )


def place_this_process(sysfs: Path = SYSFS, environ: Mapping[str, str] = os.environ) -> CpuPlacement:
    """Confine this process to the CPUs of one NUMA node and run one torch thread per
    physical core there; unless ``OMP_NUM_THREADS`` is set, which leaves the CPUs and
    torch's threads (torch honours it) as the user chose them."""
    allowed = frozenset(os.sched_getaffinity(0))
    nodes = numa_nodes(sysfs)
    node, cpus = choose_node(allowed, nodes)
    cores = physical_cores(cpus, sysfs)
    if environ.get("OMP_NUM_THREADS"):
        return CpuPlacement(
            node,
            len(nodes),
            allowed,
            physical_cores(allowed, sysfs),
            torch.get_num_threads(),
            f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']}",
        )
    if cpus != allowed:
        # Every thread of the process (the mask is per thread; threads made later inherit it).
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), cpus)
    torch.set_num_threads(cores)
    return CpuPlacement(node, len(nodes), cpus, cores, cores, "one per physical core")


def thread_share(processes: int, sysfs: Path = SYSFS, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each of ``processes`` model processes sharing this
    process's NUMA node: its physical cores split evenly (at least one each), so that
    they do not oversubscribe the cores (two replicas of one thread per core each ran
    5x slower than one replica on 2 cores). Nothing when one process runs, or when
    the user set ``OMP_NUM_THREADS``."""
    if processes <= 1 or environ.get("OMP_NUM_THREADS"):
        return {}
    _, cpus = choose_node(frozenset(os.sched_getaffinity(0)), numa_nodes(sysfs))
    return {"OMP_NUM_THREADS": str(max(1, physical_cores(cpus, sysfs) // processes))}


def format_cpulist(cpus: frozenset[int]) -> str:
    """The inverse of :func:`parse_cpulist`."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


# -- memory -------------------------------------------------------------------


def read_meminfo(path: Path) -> dict[str, int]:
    """``/proc/meminfo`` or a node's ``meminfo`` (lines ``[Node N ]Key: value kB``) in bytes."""
    values = {}
    for line in path.read_text().splitlines():
        key, sep, rest = line.partition(":")
        fields = rest.split()
        if sep and fields and fields[0].isdigit():
            scale = 1024 if fields[1:2] == ["kB"] else 1
            values[key.split()[-1]] = int(fields[0]) * scale
    return values


def cgroup_memory_limit(proc: Path = PROC, cgroup: Path = CGROUP) -> tuple[int, int] | None:
    """(limit, room left) in bytes under the tightest memory limit of this process's
    cgroup and its ancestors (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``,
    at the paths ``/proc/self/cgroup`` names); None where none is set."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, limit_file, usage_file = cgroup, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file = cgroup / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        leaf = base / path.lstrip("/")
        for directory in (leaf, *leaf.parents[: len(leaf.parents) - len(base.parents)]):
            try:
                limit = (directory / limit_file).read_text().strip()
                usage = int((directory / usage_file).read_text())
            except (OSError, ValueError):
                continue
            if limit != "max" and int(limit) < _NO_CGROUP_LIMIT:
                limits.append((int(limit), max(0, int(limit) - usage)))
    if not limits:
        return None
    return min(limit for limit, _ in limits), min(room for _, room in limits)


@dataclass(frozen=True)
class HostMemory:
    """The memory the model process may use: total and available now, in bytes."""

    total_bytes: int
    available_bytes: int
    scope: str  # what the figures are of


def host_memory(
    node: int | None, num_nodes: int, sysfs: Path = SYSFS, proc: Path = PROC, cgroup: Path = CGROUP
) -> HostMemory:
    """The machine's ``MemTotal`` and ``MemAvailable`` (free memory plus the page cache
    the kernel can drop); on a machine of several NUMA nodes, ``node``'s total and its
    free and file-cache pages instead; either within the cgroup's limit."""
    machine = read_meminfo(proc / "meminfo")
    total, scope = machine["MemTotal"], "the machine"
    available = machine.get("MemAvailable", machine["MemFree"])  # MemAvailable: Linux 3.14 and later
    if node is not None and num_nodes > 1:
        local = read_meminfo(sysfs / "node" / f"node{node}" / "meminfo")
        total, scope = local["MemTotal"], f"NUMA node {node}"
        available = min(available, local["MemFree"] + local.get("Active(file)", 0) + local.get("Inactive(file)", 0))
    limit = cgroup_memory_limit(proc, cgroup)
    if limit is not None and limit[0] < total:
        total, available, scope = limit[0], min(available, limit[1]), scope + " within its cgroup's limit"
    return HostMemory(total, available, scope)
