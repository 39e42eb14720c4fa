from __future__ import annotations

import os

import torch

from radixserve.platform import Platform


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

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def total_memory_bytes(self, index: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory_bytes(self, index: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def describe(self, index: int = 0) -> str:
        return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
