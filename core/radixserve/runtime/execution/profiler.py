"""torch.profiler around the scheduler's steps, started and stopped by control
calls (``start_profile`` / ``stop_profile``) between steps.

While a profile runs, each step's launch (building its batch and handing it to
the model worker; without overlap scheduling that includes the forward and
sampling) runs under a ``record_function`` named after the step:
``radixserve.decode[bs=64]``, ``radixserve.extend[tokens=2048]``. Otherwise
``step_scope`` returns one shared null context: no profiler call, no name built.

torch's profiler records host (CPU) ops of the thread that started it only; with
overlap scheduling the forward's host ops run on the model worker thread and are
not in the trace, while device activity (kernels, copies) is recorded for the
whole process. The trace is a Chrome trace (Perfetto, chrome://tracing), written
to a temporary name and renamed, so a file at ``trace_path`` is always complete.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from radixserve.messages import PROFILE_DIR_ENV, ProfileOptions

logger = logging.getLogger(__name__)

_NULL = contextlib.nullcontext()


class ProfileError(ValueError):
    """A start or stop the profiler refuses (the message names the field where one is at fault)."""


def trace_file_name(rank: int, now: datetime | None = None) -> str:
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S-%f")
    return f"radixserve-{stamp}-rank{rank}.trace.json"


class StepProfiler:
    """One profile at a time. ``stop`` returns the trace of the last ``start``,
    stopping it if it still runs (a ``num_steps`` profile stops by itself)."""

    def __init__(self, activities: list[ProfilerActivity], rank: int = 0):
        self.activities = activities
        self.rank = rank
        self._prof: torch.profiler.profile | None = None
        self._path: Path | None = None  # the trace of the last start, until stop() hands it out
        self._error: str | None = None  # why that trace could not be written
        self._num_steps: int | None = None
        self._steps = 0

    def start(self, options: ProfileOptions) -> str:
        """Start profiling; returns the path the trace will be written to."""
        if self._prof is not None:
            raise ProfileError("a profile is already running (stop_profile ends it)")
        out_dir = (
            options.output_dir or os.environ.get(PROFILE_DIR_ENV) or tempfile.mkdtemp(prefix="radixserve-profile-")
        )
        try:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ProfileError(f"output_dir: cannot create {out_dir!r}: {exc.strerror or exc}") from None
        if not os.access(out_dir, os.W_OK):
            raise ProfileError(f"output_dir: {out_dir!r} is not writable")
        prof = torch.profiler.profile(activities=self.activities, record_shapes=options.record_shapes)
        try:
            prof.start()
        except Exception as exc:  # e.g. no device tracer in this torch build: say so to the caller
            raise ProfileError(f"torch.profiler failed to start: {type(exc).__name__}: {exc}") from None
        self._prof, self._path, self._error = prof, Path(out_dir).resolve() / trace_file_name(self.rank), None
        self._num_steps, self._steps = options.num_steps, 0
        logger.info(
            "profiling %s%s",
            [a.name for a in self.activities],
            f" for {options.num_steps} steps" if options.num_steps else "",
        )
        return str(self._path)

    def step_scope(self, name: Callable[[], str]) -> contextlib.AbstractContextManager[None]:
        """The context a step's launch runs in: ``record_function("radixserve." + name())``
        while profiling, else a null context."""
        if self._prof is None:
            return _NULL
        self._steps += 1
        return torch.profiler.record_function("radixserve." + name())

    def after_step(self) -> None:
        """Stop a ``num_steps`` profile once that many steps ran."""
        if self._prof is not None and self._num_steps is not None and self._steps >= self._num_steps:
            self._finish()

    def stop(self) -> str:
        """Stop the running profile (if it has not stopped by itself) and return its trace path."""
        if self._prof is not None:
            self._finish()
        path, error, self._path, self._error = self._path, self._error, None, None
        if path is None:
            raise ProfileError("no profile is running (start_profile starts one)")
        if error is not None:
            raise ProfileError(error)
        return str(path)

    def _finish(self) -> None:
        """Stop and write the trace; a failure is kept for ``stop`` to report."""
        prof, self._prof = self._prof, None
        path = self._path
        assert prof is not None and path is not None, "_finish runs only while profiling"
        tmp = path.with_name(path.name + ".tmp")
        try:
            prof.stop()  # synchronises the device, so the last step's kernels are in
            prof.export_chrome_trace(str(tmp))
            os.replace(tmp, path)
        except Exception as exc:  # noqa: BLE001 - the scheduler goes on; stop() reports it
            logger.exception("writing the profile failed")
            self._error = f"writing the trace failed: {type(exc).__name__}: {exc}"
            return
        logger.info("profile of %d steps written to %s", self._steps, self._path)
