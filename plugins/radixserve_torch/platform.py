from __future__ import annotations

import ctypes
import logging
import math
import mmap
import sys

import torch

from radixserve.platform import DtypeChoice, Platform
from radixserve_torch import cpu_isa, cpu_kernel_build
from radixserve_torch.cpu_topology import HostMemory, host_memory, place_this_process, thread_share

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap and are reused after free; larger
# ones (the KV pool) are still mapped on their own.
MMAP_THRESHOLD_BYTES = 1 << 30
TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest value mallopt takes: never hand freed heap back


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of unmapping it.

    A prefill step allocates tens-of-MB activations per layer (``[2048, 5632]``
    gate/up outputs: 23 MB in bfloat16, 46 MB in float32). By default glibc maps
    blocks that large afresh and unmaps them on free, so every layer of every
    step page-faults them in again: measured 68k (bf16) and 185k (fp32) minor
    faults per 2048-token prefill of the W1 model, about 10% of its time. With
    these thresholds the faults are gone after the first step. Returns whether
    the settings took (False where the C library is not glibc).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt: malloc thresholds left as they are")
        return False
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    trim_ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    ok = bool(mmap_ok and trim_ok)
    if not ok:
        logger.debug("glibc refused the malloc thresholds; left as they are")
    return ok


class CpuPlatform(Platform):
    name = "cpu"
    priority = 0  # any accelerator platform outranks the CPU for --device auto
    torch_device_type = "cpu"
    dist_backend = "gloo"
    default_dtype = torch.float32
    default_mem_fraction = 0.3  # host memory is shared with everything else
    # The same cores run the model and the scheduler: overlapping them only makes
    # them compete (measured 6% slower on 2 cores), so it is off unless asked for.
    overlap_schedule = False

    def __init__(self) -> None:
        # The model runner makes the platform once, in the process that runs the
        # model, so that is the process whose allocator keep_freed_memory tunes
        # and whose CPUs and threads are placed.
        keep_freed_memory()
        self.placement = place_this_process()
        logger.info("model process: %s", self.placement.describe())

    @classmethod
    def auto_dtype(cls, saved: torch.dtype | None) -> DtypeChoice:
        """A 16-bit checkpoint in bfloat16 where bfloat16 matmuls are native here
        (float16 too: the fast CPU GEMMs, ``cpu_packed`` and ``onednn``, take bfloat16
        and float32 only), else in float32: emulated bfloat16 widens every product
        to float32 and measured 2-4x slower than float32 from 16 rows up, a whole
        model 2.8x (docs/architecture.md). A float32 checkpoint stays float32."""
        if saved not in (torch.bfloat16, torch.float16):
            return super().auto_dtype(saved)
        bf16 = cpu_isa.bf16_matmul()
        what = f"a {str(saved).removeprefix('torch.')} checkpoint"
        if bf16.native:
            return DtypeChoice(torch.bfloat16, f"{what}, served in bfloat16: {bf16.reason}")
        return DtypeChoice(
            torch.float32,
            f"{what}, served in float32: {bf16.reason}; emulated bfloat16 matmuls are slower than float32 ones",
        )

    @classmethod
    def process_environment(cls, processes_per_host: int) -> dict[str, str]:
        return thread_share(processes_per_host)

    def pool_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Zeros in a private anonymous mapping of their own, which the kernel
        fills a page at a time when it is first written: the pool costs neither
        time nor memory until requests fill it. ``torch.zeros`` wrote all of it
        at start-up: 0.4-1 s for the demo model's 1 GiB pool on 2 cores."""
        numel = math.prod(shape)
        if numel == 0:
            return super().pool_buffer(shape, dtype, device)
        mapping = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE)
        return torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)  # the tensor keeps the mapping

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def memory(self) -> HostMemory:
        """The memory of this process's NUMA node (the machine's where it has one), within its cgroup's limit."""
        return host_memory(self.placement.node, self.placement.num_nodes)

    def total_memory_bytes(self, index: int = 0) -> int:
        return self.memory().total_bytes

    def available_memory_bytes(self, index: int = 0) -> int:
        return self.memory().available_bytes

    def describe(self, index: int = 0) -> str:
        memory = self.memory()
        return f"cpu ({self.placement.describe()}; memory {memory.total_bytes / 2**30:.1f} GiB ({memory.scope}))"

    def timing_fingerprint(self, index: int = 0) -> dict[str, str]:
        """What decides which CPU kernel is fastest: the CPU model and its ISA flags,
        what ATen, our kernels and oneDNN may use (``ATEN_CPU_CAPABILITY``,
        ``ONEDNN_MAX_CPU_ISA``), our kernels' sources, the torch threads and the
        torch version."""
        target = cpu_isa.build_target()
        return {
            "platform": self.name,
            "cpu": cpu_isa.cpu_model_name(),
            "flags": " ".join(sorted(cpu_isa.cpu_flags() or ())),
            "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "kernel_target": target.name if target is not None else "none",
            "kernel_sources": cpu_kernel_build.source_digest(),
            "onednn_max_cpu_isa": cpu_isa.onednn_isa_cap() or "",
            "threads": str(torch.get_num_threads()),
            "torch": torch.__version__,
        }
