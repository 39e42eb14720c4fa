"""The error that stops the server or the Engine from starting: raised by the
start-up checks (``startup_checks.py``), by the runtime processes' start
(``runtime/processes/spawn.py``) and by the HTTP server (``server/http.py``)."""

from __future__ import annotations


class StartupError(RuntimeError):
    """The server cannot start. ``str()`` is the one line to show; ``hint`` says
    what to try; a traceback, if any, is logged at debug level where it is caught."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint
