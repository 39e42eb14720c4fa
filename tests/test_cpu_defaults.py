"""What the cpu platform chooses by itself: the dtype of ``--dtype auto`` from the
CPU's bfloat16 support and the ISA caps, one torch thread per physical core of
one NUMA node, the KV pool from that node's (or the machine's) memory within the
cgroup's limit; and the startup summary shows all of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from generation_utils import make_scheduler

from radixserve.checkpoints.loader import choose_dtype
from radixserve.platform import DtypeChoice, Platform
from radixserve.testing.tiny_models import tiny_config
from radixserve_torch import cpu_isa, cpu_topology
from radixserve_torch.cpu_topology import (
    CpuPlacement,
    cgroup_memory_limit,
    choose_node,
    format_cpulist,
    host_memory,
    numa_nodes,
    parse_cpulist,
    physical_cores,
    place_this_process,
    thread_share,
)
from radixserve_torch.platform import CpuPlatform

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
GIB = 2**30

# -- dtype ----------------------------------------------------------------------


def fake_cpu(monkeypatch, flags: set[str], aten: str, onednn: str | None = None) -> None:
    """This process as on a CPU with ``flags``, ATen capped at ``aten`` (or at its own
    level: "native") and oneDNN at ``onednn``."""
    target = cpu_isa.select_target("x86_64", "AVX512" if aten == "native" else aten, aten != "native", frozenset(flags))
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_isa, "build_target", lambda: target)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if onednn is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn)


ZEN4 = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
SKYLAKE_X = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile", "avx512_fp16"}


@pytest.mark.parametrize(
    "flags, aten, onednn, saved, expected, why",
    [
        (ZEN4, "native", None, BF16, BF16, "this CPU has avx512_bf16"),
        (ZEN4, "native", None, FP16, BF16, "a float16 checkpoint, served in bfloat16"),
        (SAPPHIRE_RAPIDS, "native", None, FP16, BF16, "this CPU has amx_bf16 and avx512_bf16"),
        (ZEN4, "native", None, FP32, FP32, "a float32 checkpoint: the cpu platform's default"),
        (ZEN4, "native", None, None, FP32, "no dtype in the config"),
        (SKYLAKE_X, "native", None, BF16, FP32, "no bfloat16 matmul instructions"),
        ({"avx2"}, "native", None, FP16, FP32, "served in float32"),
        # Capped: both our kernels and oneDNN below AVX512-BF16 -> float32; either one left -> bfloat16.
        (ZEN4, "AVX2", "AVX2", BF16, FP32, "ONEDNN_MAX_CPU_ISA=AVX2 caps oneDNN"),
        (ZEN4, "AVX512", "avx512_core", BF16, FP32, "x86-64-v4"),
        (ZEN4, "AVX2", None, BF16, BF16, "this CPU has avx512_bf16"),
        (ZEN4, "native", "AVX2", BF16, BF16, "this CPU has avx512_bf16"),
    ],
)
def test_auto_dtype_follows_native_bf16(monkeypatch, flags, aten, onednn, saved, expected, why):
    fake_cpu(monkeypatch, flags, aten, onednn)
    choice = CpuPlatform.auto_dtype(saved)
    assert choice.dtype is expected and why in choice.reason, choice


def test_choose_dtype_goes_through_the_platform(monkeypatch):
    fake_cpu(monkeypatch, SKYLAKE_X, "native")
    config = tiny_config("llama")
    config.dtype = BF16
    assert choose_dtype("auto", config, CpuPlatform).dtype is FP32
    assert choose_dtype("bfloat16", config, CpuPlatform) == DtypeChoice(BF16, "--dtype bfloat16")

    class Accelerator(Platform):  # the default rule: 16-bit as saved, else the platform's default
        name = "accel"

    assert Accelerator.auto_dtype(FP16) == DtypeChoice(FP16, "the checkpoint's dtype")
    assert Accelerator.auto_dtype(FP32).dtype is BF16


# -- threads and NUMA -----------------------------------------------------------


def fake_sysfs(root: Path, nodes: dict[int, str], siblings: dict[int, str]) -> Path:
    for node, cpulist in nodes.items():
        (root / "node" / f"node{node}").mkdir(parents=True)
        (root / "node" / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    for cpu, sibling_list in siblings.items():
        (root / "cpu" / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(sibling_list + "\n")
    return root


# Two sockets of 4 cores with 2 threads each: node 0 = CPUs 0-3 and 8-11, node 1 = 4-7 and 12-15.
TWO_NODES = {0: "0-3,8-11", 1: "4-7,12-15"}
SIBLINGS = {cpu: f"{cpu % 8},{cpu % 8 + 8}" for cpu in range(16)}


def test_cpulist_parsing_and_node_choice(tmp_path):
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11} and parse_cpulist("") == set()
    assert format_cpulist(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    sysfs = fake_sysfs(tmp_path, TWO_NODES, SIBLINGS)
    nodes = numa_nodes(sysfs)
    assert nodes == {0: parse_cpulist("0-3,8-11"), 1: parse_cpulist("4-7,12-15")}
    assert numa_nodes(tmp_path / "nowhere") == {}
    # taskset -c 2-6: node 0 holds 2-3, node 1 holds 4-6, so node 1.
    assert choose_node(parse_cpulist("2-6"), nodes) == (1, parse_cpulist("4-6"))
    assert choose_node(parse_cpulist("2-5"), nodes) == (0, parse_cpulist("2-3"))  # a tie: the lower node
    assert choose_node(parse_cpulist("0-3"), {}) == (None, parse_cpulist("0-3"))
    assert physical_cores(nodes[0], sysfs) == 4  # hyperthread siblings count once
    assert physical_cores(parse_cpulist("0-2"), tmp_path / "nowhere") == 3  # no topology: one core each


@pytest.fixture
def fake_process(monkeypatch):
    """os.sched_*affinity and torch.set_num_threads recorded instead of applied."""
    calls: dict = {"affinity": None, "threads": None}
    monkeypatch.setattr(cpu_topology.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(cpu_topology.os, "sched_setaffinity", lambda pid, cpus: calls.update(affinity=set(cpus)))
    monkeypatch.setattr(cpu_topology.torch, "set_num_threads", lambda n: calls.update(threads=n))
    return calls


def test_the_model_process_takes_one_node_and_a_thread_per_core(tmp_path, fake_process):
    sysfs = fake_sysfs(tmp_path, TWO_NODES, SIBLINGS)
    placement = place_this_process(sysfs, environ={})
    assert placement == CpuPlacement(0, 2, parse_cpulist("0-3,8-11"), 4, 4, "one per physical core")
    assert fake_process == {"affinity": set(parse_cpulist("0-3,8-11")), "threads": 4}
    assert placement.describe() == (
        "NUMA node 0 of 2: CPUs 0-3,8-11, 4 physical cores, 4 torch threads (one per physical core)"
    )


def test_omp_num_threads_leaves_cpus_and_threads_alone(tmp_path, fake_process):
    sysfs = fake_sysfs(tmp_path, TWO_NODES, SIBLINGS)
    placement = place_this_process(sysfs, environ={"OMP_NUM_THREADS": "3"})
    assert fake_process == {"affinity": None, "threads": None}
    assert placement.cpus == set(range(16)) and placement.cores == 8
    assert placement.threads == torch.get_num_threads() and placement.threads_from == "OMP_NUM_THREADS=3"


def test_model_processes_sharing_a_node_split_its_cores(tmp_path, fake_process):
    """Two replicas (or tensor-parallel ranks) on node 0's 4 physical cores get 2
    threads each; one process, or a user's OMP_NUM_THREADS, is left alone."""
    sysfs = fake_sysfs(tmp_path, TWO_NODES, SIBLINGS)
    assert thread_share(2, sysfs, environ={}) == {"OMP_NUM_THREADS": "2"}
    assert thread_share(3, sysfs, environ={}) == {"OMP_NUM_THREADS": "1"}
    assert thread_share(8, sysfs, environ={}) == {"OMP_NUM_THREADS": "1"}  # never zero
    assert thread_share(1, sysfs, environ={}) == {}
    assert thread_share(2, sysfs, environ={"OMP_NUM_THREADS": "4"}) == {}
    # That a real Engine's two replicas each run their share: test_data_parallel.py's
    # shortest_queue Engine, which starts them anyway.


# -- memory ---------------------------------------------------------------------


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_memory(root: Path, cgroup_line: str = "0::/\n") -> tuple[Path, Path, Path]:
    sysfs, proc, cgroup = root / "sys", root / "proc", root / "cgroup"
    write(
        proc / "meminfo",
        "MemTotal:       268435456 kB\nMemFree:        100000000 kB\nMemAvailable:   200000000 kB\nCached: 1 kB\n",
    )
    write(
        sysfs / "node" / "node1" / "meminfo",
        "Node 1 MemTotal:  134217728 kB\nNode 1 MemFree:   50000000 kB\n"
        "Node 1 Active(file):  1000000 kB\nNode 1 Inactive(file): 9000000 kB\n",
    )
    write(proc / "self" / "cgroup", cgroup_line)
    return sysfs, proc, cgroup


def test_memory_of_the_machine_its_node_and_its_cgroup(tmp_path):
    sysfs, proc, cgroup = fake_memory(tmp_path)
    kib = 1024
    assert host_memory(0, 1, sysfs, proc, cgroup) == cpu_topology.HostMemory(
        268435456 * kib, 200000000 * kib, "the machine"
    )
    assert host_memory(1, 2, sysfs, proc, cgroup) == cpu_topology.HostMemory(
        134217728 * kib, 60000000 * kib, "NUMA node 1"
    )
    # cgroup v2: the limit of the process's cgroup or of an ancestor, with the room left under it.
    sysfs, proc, cgroup = fake_memory(tmp_path / "v2", "0::/kubepods/pod1\n")
    write(cgroup / "kubepods" / "memory.max", f"{64 * GIB}\n")
    write(cgroup / "kubepods" / "memory.current", f"{10 * GIB}\n")
    write(cgroup / "kubepods" / "pod1" / "memory.max", "max\n")
    write(cgroup / "kubepods" / "pod1" / "memory.current", f"{4 * GIB}\n")
    assert cgroup_memory_limit(proc, cgroup) == (64 * GIB, 54 * GIB)
    assert host_memory(1, 2, sysfs, proc, cgroup) == cpu_topology.HostMemory(
        64 * GIB, 54 * GIB, "NUMA node 1 within its cgroup's limit"
    )
    # cgroup v1, no limit (the kernel's "unlimited" is about 2**63).
    sysfs, proc, cgroup = fake_memory(tmp_path / "v1", "4:memory:/job\n0::/\n")
    write(cgroup / "memory" / "job" / "memory.limit_in_bytes", "9223372036854771712\n")
    write(cgroup / "memory" / "job" / "memory.usage_in_bytes", "123\n")
    assert cgroup_memory_limit(proc, cgroup) is None


def test_the_kv_pool_buffers_are_zeros_that_cost_nothing_until_written():
    """``pool_buffer`` maps fresh memory, which the kernel zero-fills page by page
    as it is written, instead of writing all of it at start-up."""
    platform = CpuPlatform.__new__(CpuPlatform)  # no placement: only the buffer is made
    rss = _rss_bytes()
    buf = platform.pool_buffer((1 << 20, 2, 64), torch.float32, torch.device("cpu"))  # 512 MiB
    assert buf.shape == (1 << 20, 2, 64) and buf.dtype == torch.float32 and buf.is_contiguous()
    assert _rss_bytes() - rss < 64 << 20
    buf[7] = 1.0
    buf.index_copy_(0, torch.tensor([9]), torch.full((1, 2, 64), 2.0))
    assert float(buf.sum()) == 128 * 1.0 + 128 * 2.0 and float(buf[8].abs().sum()) == 0.0
    assert platform.pool_buffer((0, 2), torch.float16, torch.device("cpu")).shape == (0, 2)


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


# -- the startup summary ----------------------------------------------------------


def test_startup_summary_shows_dtype_threads_numa_memory_and_kv_pool(tiny_model_factory):
    model_dir = tiny_model_factory(dtype="bfloat16", seed=3)
    # Backends by priority: the summary's subject is the platform's choices, not auto's timing.
    runner = make_scheduler(
        model_dir, max_total_tokens=None, max_running_requests=4, backend_selection="priority"
    ).runner
    summary = runner.summary()
    bf16 = cpu_isa.bf16_matmul()
    assert summary["dtype"] == ("bfloat16" if bf16.native else "float32")
    assert summary["dtype_reason"] == f"a bfloat16 checkpoint, served in {summary['dtype']}: {bf16.reason}" + (
        "" if bf16.native else "; emulated bfloat16 matmuls are slower than float32 ones"
    )
    placement = runner.platform.placement
    assert placement.threads == torch.get_num_threads() and placement.cpus
    assert summary["device"].startswith(f"cpu ({placement.describe()}; memory ")
    memory = summary["memory"]
    assert memory["total_bytes"] >= memory["available_bytes"] > 0 and memory["weights_bytes"] > 0
    per_token = memory["kv_pool_bytes"] // summary["max_total_tokens"]
    assert per_token == 2 * 2 * 2 * 16 * (2 if bf16.native else 4)  # K and V, 2 layers, 2 KV heads, head_dim 16
    # Sized from memory: every running request at full context (4 x 1024 here fits easily).
    assert summary["max_total_tokens"] == 4 * summary["context_length"]
