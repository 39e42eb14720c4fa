"""The C++ kernels of the CPU backends (csrc/), built once per machine.

``cpu_paged`` attention, ``cpu_fused`` elementwise ops and the ``cpu_packed`` GEMM
live in one extension library, compiled on first use with ``torch.utils.cpp_extension.load`` (g++
``-O3 -march=native -fopenmp``; only ATen and the op registry are included, and
ninja compiles the sources in parallel: 10-20 s of CPU) into torch's extension
cache (``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions/<python>_cpu/radixserve_cpu_kernels_<capability>``),
so later processes only load it. It registers ``torch.ops.radixserve_cpu_paged``,
``torch.ops.radixserve_cpu_elementwise`` and ``torch.ops.radixserve_cpu_gemm``.

A build failure raises :class:`KernelBuildError` with the compiler's first error
line and is remembered for the process; :func:`unavailable_reasons` names it,
and a missing compiler or ninja, without running anything, so that ``auto``
passes over the backends on a machine that cannot build them.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in (
    "cpu_paged_ops.cpp", "cpu_paged_decode.cpp", "cpu_paged_extend.cpp", "cpu_elementwise.cpp", "cpu_gemm.cpp")]

_lock = threading.Lock()
_loaded = False
_build_error: Optional[str] = None


class KernelBuildError(RuntimeError):
    """The C++ kernels failed to compile or load."""


def missing_tools() -> list[str]:
    """What the first build needs and PATH lacks: a C++ compiler ($CXX, else c++,
    as torch's extension builder uses) and ninja. Cheap: nothing is run."""
    missing = []
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        missing.append(f"no C++ compiler found (looked for {os.environ.get('CXX', 'c++')!r} on PATH)")
    if shutil.which("ninja") is None:
        missing.append("ninja not found on PATH (torch's extension builder needs it: pip install ninja)")
    return missing


def unavailable_reasons() -> list[str]:
    """Why the kernels cannot be used in this process: missing tools, or an earlier build failure."""
    return missing_tools() + ([_build_error] if _build_error is not None else [])


def extension_name() -> str:
    """One build per instruction set: the kernels are compiled with ``-march=native``."""
    return f"radixserve_cpu_kernels_{torch.backends.cpu.get_cpu_capability().lower()}"


def load() -> None:
    """Build (first use on this machine) or load the library; once per process."""
    global _loaded, _build_error
    with _lock:
        if _loaded:
            return
        if _build_error is not None:
            raise KernelBuildError(_build_error)
        from torch.utils import cpp_extension

        logger.info("loading the CPU kernels (compiled on first use on this machine)")
        start = time.perf_counter()
        try:
            library = cpp_extension.load(
                name=extension_name(),
                sources=[str(s) for s in SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:  # the compiler's output is in the exception text
            _build_error = f"building the CPU kernels failed: {_first_error_line(str(exc))}"
            raise KernelBuildError(_build_error) from exc
        _loaded = True
        logger.info("CPU kernels ready in %.1f s (%s)", time.perf_counter() - start, library)


def _first_error_line(text: str) -> str:
    """The compiler's first ``file:line:col: error: ...`` line, else the first line
    mentioning an error, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in (": error:", "error"):
        for line in lines:
            if pattern in line.lower():
                return line
    return lines[-1] if lines else "no compiler output"
