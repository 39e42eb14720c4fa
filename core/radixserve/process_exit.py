"""Ending a process without the interpreter's teardown.

Once torch is imported, Python's own finalization (unloading about a thousand
modules and collecting their objects) takes half a second or more: every server
stop, every rank's exit and every failed ``radixserve`` command paid it, and
nothing of ours needs it. ``exit_now`` does what a process owes the outside world
at exit (the atexit handlers: logging's flush, multiprocessing's joining of its
own children; then stdout and stderr) and skips only the teardown.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing left to deliver
            stream.flush()
    os._exit(code)


def exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(arg)`` asks for (a message is printed, as the interpreter would)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1
