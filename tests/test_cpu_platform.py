"""The cpu platform keeps freed memory for reuse: a large activation allocated
again after being freed does not page-fault in afresh."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from radixserve_torch.platform import CpuPlatform

# Above glibc's largest dynamic mmap threshold (32 MiB), so by default every
# allocation of it is a fresh mapping whose pages fault in when written.
BLOCK_FLOATS = 24 * 2**20  # 96 MiB


def faults_of_reallocating(times: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        block = torch.ones(BLOCK_FLOATS)  # writes every page
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_platform_makes_freed_activations_reusable_without_page_faults():
    CpuPlatform()  # what the model runner does once in the scheduler process
    faults_of_reallocating(1)  # the first one maps the heap's pages
    pages_per_block = BLOCK_FLOATS * 4 // resource.getpagesize()
    # By default every one of them faults all its pages in (measured: 20 x pages_per_block);
    # kept, most reuse pages already mapped (measured: 0 to 5 x pages_per_block in a test process).
    assert faults_of_reallocating(20) < 10 * pages_per_block
