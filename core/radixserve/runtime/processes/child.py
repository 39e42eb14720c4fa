"""The entry point of every runtime process (``spawn.py`` spawns them).

A spawned child imports the module of its target before it runs: this module
imports nothing heavy, so that the detokenizer, which needs no torch, is not
made to import it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from collections.abc import Callable
from typing import Any, NoReturn

from radixserve.process_exit import exit_code, exit_now

logger = logging.getLogger(__name__)


def run_child(target: Callable[..., None], *args: Any) -> NoReturn:
    """A child's entry point. Ctrl-C reaches the whole process group; the
    parent decides when its children stop, so they ignore SIGINT. A crash is
    one line at error level, the traceback at debug (the child's logging is set
    up by ``target``, from the server's --log-level). The child ends without the
    interpreter's teardown (``process_exit``): a stop waits for every rank's exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        target(*args)
    except SystemExit as exc:
        exit_now(exit_code(exc))
    except Exception as exc:
        name = mp.current_process().name
        logger.error("%s process failed: %s: %s (--log-level debug shows the traceback)", name, type(exc).__name__, exc)
        logger.debug("%s process traceback", name, exc_info=True)
        exit_now(1)
    exit_now(0)
