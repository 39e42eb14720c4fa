"""A build of the CPU kernels killed half-way leaves torch's lock file behind; the
next process that builds or loads that target must not wait on it forever
(``cpu_kernels._build_lock``), and must not take a live build's lock file for a
stale one."""

from __future__ import annotations

import logging
import subprocess
import sys

from radixserve_torch import cpu_kernels

# A build in another process: it holds our flock while torch's lock file exists.
LIVE_BUILD = """
import fcntl, pathlib, sys, time
directory = pathlib.Path(sys.argv[1])
with open(directory / "radixserve-build.lock", "w") as held:
    fcntl.flock(held, fcntl.LOCK_EX)
    (directory / "lock").touch()
    print("building", flush=True)
    time.sleep(1.5)
    (directory / "lock").unlink()
"""


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path, caplog):
    directory = tmp_path / "radixserve_cpu_kernels_target"
    directory.mkdir()
    stale = directory / "lock"
    stale.touch()  # what torch's builder leaves when its process dies mid-build
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__), cpu_kernels._build_lock(directory):
        assert not stale.exists()  # torch's builder, called here, would have waited on it forever
    assert "did not finish" in caplog.text and str(stale) in caplog.text


def test_a_live_build_is_waited_for_and_its_lock_file_left_alone(tmp_path, caplog):
    directory = tmp_path / "radixserve_cpu_kernels_target"
    directory.mkdir()
    builder = subprocess.Popen([sys.executable, "-c", LIVE_BUILD, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout is not None and builder.stdout.readline().strip() == "building"
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__), cpu_kernels._build_lock(directory):
            # In only once the builder let go, after it removed its own lock file.
            assert not (directory / "lock").exists()
        assert builder.wait(timeout=30) == 0
        assert "did not finish" not in caplog.text
    finally:
        builder.kill()
        builder.wait()
