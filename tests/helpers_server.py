"""`radixserve serve` as a subprocess, for the server tests.

The server is started with ``--port 0`` and its URL read from the line it prints
(``radixserve listening at URL``), so parallel test runs never clash on ports.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

READY_TIMEOUT_S = 300  # generous: the CI box has 2 cores shared with other suites
# For a server whose test does not test `auto`: the highest-priority backend of each kind, no timing. A
# session times each new model shape once (its RADIXSERVE_CACHE_DIR is its own), seconds at every start
# whose shape (say --max-running-requests) no server of the session had.
PRIORITY_BACKENDS = ("--backend-selection", "priority")
_ANNOUNCE = re.compile(r"radixserve (?:router )?(listening|ready) at (\S+)")


class ServerProcess:
    def __init__(
        self,
        *cli_args: str,
        env: dict[str, str] | None = None,
        launcher: Sequence[str] = (),
        command: str = "serve",
    ):
        """``launcher``: what runs the ``radixserve.cli`` module (default ``python -m``;
        e.g. torchrun's ``python -m torch.distributed.run ... -m``); ``command``: ``serve``
        or ``router`` (both print ``listening at`` and ``ready at``)."""
        port = () if "--port" in cli_args else ("--port", "0")
        cmd = [*(launcher or (sys.executable, "-m")), "radixserve.cli", command, *port, *cli_args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            bufsize=1,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        key = cli_args[cli_args.index("--api-key") + 1] if "--api-key" in cli_args else None
        self.auth_headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._listening = threading.Event()
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()

    def _read_output(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            match = _ANNOUNCE.search(line)
            if match:
                self.url = match.group(2)
                (self._listening if match.group(1) == "listening" else self._ready).set()
        self._listening.set()  # the process ended: wake any waiter
        self._ready.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def _wait(self, event: threading.Event, what: str, timeout: float) -> str:
        if not event.wait(timeout) or self.proc.poll() is not None or self.url is None:
            raise RuntimeError(f"the server did not become {what} (exit code {self.proc.poll()}):\n{self.log}")
        return self.url

    def wait_listening(self, timeout: float = 120) -> str:
        return self._wait(self._listening, "listening", timeout)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> str:
        return self._wait(self._ready, "ready", timeout)

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, with all output read; None if still running."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(10)  # the last lines may still be in the pipe
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.wait_exit(30) is None:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def serving(model: Path, *cli_args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A ready server of ``model``, served as "tiny" at warning level; ``cli_args``
    come after those flags, so they may override them."""
    with ServerProcess(*_serve_args(model), *cli_args, env=env) as srv:
        srv.wait_ready()
        yield srv


def _serve_args(model: Path) -> tuple[str, ...]:
    return ("--model", str(model), "--served-model-name", "tiny", "--log-level", "warning")


class SharedServer:
    """One server for the modules whose flags agree (``serving``'s arguments),
    started at the first ``get`` and again after a test stopped it (a SIGTERM
    test ends its module's use), so a module that comes later never meets a
    dead server."""

    def __init__(self, model: Path, *cli_args: str, env: dict[str, str] | None = None):
        self.model, self.cli_args, self.env = model, cli_args, env
        self._server: ServerProcess | None = None

    def get(self) -> ServerProcess:
        if self._server is None or self._server.proc.poll() is not None:
            self.close()
            self._server = ServerProcess(*_serve_args(self.model), *self.cli_args, env=self.env)
            self._server.wait_ready()
        return self._server

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def process_alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as gone)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


async def wait_until_async(predicate: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    """``wait_until`` inside an event loop: the tasks it runs go on between looks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return predicate()


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a server's ``/metrics`` samples named ``name`` whose labels include ``labels``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    )
