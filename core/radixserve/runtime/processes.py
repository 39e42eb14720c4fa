"""Starts the runtime processes shared by the HTTP server and the offline Engine:
the scheduler and the detokenizer, spawned (never forked), wired by ZMQ.

A failure inside a child is reported as its exception's last line; full
tracebacks are logged at debug level only.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from radixserve.config import ServerArgs
from radixserve.ipc import Endpoints
from radixserve.runtime.detokenizer import run_detokenizer_process
from radixserve.runtime.scheduler_process import run_scheduler_process
from radixserve.startup_error import StartupError

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600


def exception_summary(traceback_text: str) -> str:
    """The ``Type: message`` part of a formatted traceback (the last exception's,
    message lines included), with the type's module path left out."""
    lines = traceback_text.rstrip().splitlines()
    if not lines:
        return "no traceback"
    # The exception line is the last unindented line that follows a frame's indented lines.
    start = next(
        (
            i
            for i in range(len(lines) - 1, 0, -1)
            if lines[i] and not lines[i][0].isspace() and lines[i - 1].startswith("  ")
        ),
        0,
    )
    head, sep, rest = lines[start].partition(": ")
    exc_type = head.rsplit(".", 1)[-1]
    return "\n".join([f"{exc_type}: {rest}" if sep else exc_type, *lines[start + 1 :]])


def _run_child(target: Callable[..., None], *args: Any) -> None:
    """A child's entry point. Ctrl-C reaches the whole process group; the
    parent decides when its children stop, so they ignore SIGINT. A crash is
    one line at error level, the traceback at debug (the child's logging is set
    up by ``target``, from the server's --log-level)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        target(*args)
    except Exception as exc:
        name = mp.current_process().name
        logger.error("%s process failed: %s: %s (--log-level debug shows the traceback)", name, type(exc).__name__, exc)
        logger.debug("%s process traceback", name, exc_info=True)
        sys.exit(1)


@dataclass
class RuntimeProcesses:
    args: ServerArgs
    model_path: str
    tokenizer_path: str
    endpoints: Endpoints
    summary: dict
    processes: list[mp.Process] = field(default_factory=list)
    _stopping: bool = False

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(reason)`` once, from a thread, if a child exits while we run."""

        def wait() -> None:
            from multiprocessing.connection import wait as wait_any

            ready = wait_any([p.sentinel for p in self.processes])
            if self._stopping:
                return
            dead = [p for p in self.processes if p.sentinel in ready]
            for p in dead:  # the sentinel fires a moment before the exit code can be read
                p.join(timeout=5)
            reason = ", ".join(f"{p.name} exited with code {p.exitcode}" for p in dead)
            logger.error("runtime process died: %s", reason)
            on_death(reason)

        threading.Thread(target=wait, daemon=True, name="process-watch").start()

    def shutdown(self) -> None:
        self._stopping = True
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.endpoints.remove()


def launch_runtime(args: ServerArgs, model_path: str) -> RuntimeProcesses:
    runtime, ready = spawn_runtime(args, model_path)
    wait_until_ready(runtime, ready)
    return runtime


def spawn_runtime(args: ServerArgs, model_path: str) -> tuple[RuntimeProcesses, Connection]:
    """Start the processes; returns at once, with the pipe the scheduler reports on.

    Call it from a thread that lives as long as the server: the children's
    PR_SET_PDEATHSIG fires when the *thread* that spawned them exits."""
    ctx = mp.get_context("spawn")
    endpoints = Endpoints.fresh()
    tokenizer_path = args.tokenizer_path or model_path
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    scheduler = ctx.Process(
        target=_run_child,
        name="scheduler",
        args=(run_scheduler_process, args, model_path, endpoints, ready_send),
        daemon=True,
    )
    detokenizer = ctx.Process(
        target=_run_child,
        name="detokenizer",
        args=(run_detokenizer_process, tokenizer_path, endpoints, args.log_level),
        daemon=True,
    )
    runtime = RuntimeProcesses(
        args, model_path, tokenizer_path, endpoints, summary={}, processes=[scheduler, detokenizer]
    )
    scheduler.start()
    detokenizer.start()
    ready_send.close()
    return runtime, ready_recv


def wait_until_ready(runtime: RuntimeProcesses, ready_recv: Connection) -> None:
    """Block until the scheduler has loaded the model (fills ``runtime.summary``);
    on failure stop the processes and raise StartupError."""
    try:
        if not ready_recv.poll(STARTUP_TIMEOUT_S):
            raise StartupError(f"the scheduler did not start within {STARTUP_TIMEOUT_S} s")
        status: Optional[dict] = ready_recv.recv()
    except EOFError:
        status = None
    except BaseException:
        runtime.shutdown()
        raise
    if not status or "error" in status:
        runtime.shutdown()
        if status:
            logger.debug("the scheduler's traceback:\n%s", status["error"])
            raise StartupError(f"the scheduler failed to start: {exception_summary(status['error'])}")
        raise StartupError(f"the scheduler exited with code {runtime.processes[0].exitcode} while starting")
    runtime.summary = status["summary"]
