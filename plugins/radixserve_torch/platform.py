from __future__ import annotations

import ctypes
import logging
import os
import sys

import torch

from radixserve.platform import Platform

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
        # model, so that is the process whose allocator keep_freed_memory tunes.
        keep_freed_memory()

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def total_memory_bytes(self, index: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory_bytes(self, index: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def describe(self, index: int = 0) -> str:
        return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
