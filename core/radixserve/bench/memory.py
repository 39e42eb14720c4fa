"""Peak resident memory of a set of processes, sampled from ``/proc`` (Linux).

Sampling (every ``interval`` seconds on a thread) misses peaks shorter than the
interval; for engines, whose memory is dominated by weights and the KV pool
allocated at startup, that is what matters. Off Linux the peak is ``None``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid``; 0 if it is gone or unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid``, found by walking ``/proc`` parents."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit():
            parent = parent_pid(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class PeakRSS:
    """``with PeakRSS(pids) as peak: ...`` then ``peak.bytes`` (None when nothing was readable)."""

    def __init__(self, pids: list[int], interval: float = 0.25):
        self.pids = pids
        self.interval = interval
        self.bytes: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")

    def sample(self) -> None:
        total = sum(rss_bytes(pid) for pid in self.pids)
        if total:
            self.bytes = max(self.bytes or 0, total)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PeakRSS:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def engine_pids() -> list[int]:
    """This process and its children: an in-process Engine's whole footprint."""
    return [os.getpid(), *descendants(os.getpid())]
