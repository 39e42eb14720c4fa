"""A build of the CPU kernels killed half-way leaves torch's lock file behind; the
next process that loads them must not wait on it forever (``cpu_kernels._build_lock``)."""

from __future__ import annotations

import os
import subprocess
import sys

from radixserve_torch import cpu_kernels

LOAD = "from radixserve_torch import cpu_kernels; cpu_kernels.load(); print('loaded')"


def test_a_lock_left_by_a_killed_build_is_removed_and_the_kernels_load(cpu_kernels_built):
    directory = cpu_kernels.build_directory()
    stale = directory / "lock"
    stale.touch()  # what torch's builder leaves when its process dies mid-build
    try:
        done = subprocess.run(
            [sys.executable, "-c", LOAD],
            capture_output=True,
            text=True,
            timeout=120,  # torch alone would wait for the file forever
            env={**os.environ},
        )
    finally:
        stale.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded"
    assert "did not finish" in done.stderr and str(stale) in done.stderr
