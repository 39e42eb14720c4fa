"""The C++ kernels of the CPU backends (csrc/), built once per machine and build target.

``cpu_paged`` attention, ``cpu_fused`` elementwise ops and the ``cpu_packed`` GEMM
live in one extension library, compiled on first use with ``torch.utils.cpp_extension.load`` (g++
``-O3 -fopenmp`` and the target's instruction-set flags; only ATen and the op registry are included, and
ninja compiles the sources in parallel: 10-20 s of CPU) into torch's extension
cache (``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions/<python>_cpu/radixserve_cpu_kernels_<target>``),
so later processes only load it. The target follows ATen's CPU capability
(cpu_isa.py: ``-march=native`` at the CPU's own level, ``-march=x86-64-v3`` under
``ATEN_CPU_CAPABILITY=avx2``, ...), and its name is in the library's, so builds for
different targets coexist in the cache. It registers ``torch.ops.radixserve_cpu_paged``,
``torch.ops.radixserve_cpu_elementwise``, ``torch.ops.radixserve_cpu_gemm``, ``torch.ops.radixserve_cpu_int4`` and
``torch.ops.radixserve_cpu_lora``.

A build failure raises :class:`KernelBuildError` with the compiler's first error
line and is remembered for the process (``load()`` raises it again at once); the
backends' ``build()`` calls ``load()``, so ``auto`` passes over each of them with
that line. :func:`unavailable_reasons` names a missing compiler or ninja without
running anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixserve_torch import cpu_isa

if TYPE_CHECKING:
    from collections.abc import Iterator

    from radixserve.kernels import KernelQuery

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    CSRC / name
    for name in (
        "cpu_paged_ops.cpp",
        "cpu_paged_decode.cpp",
        "cpu_paged_extend.cpp",
        "cpu_elementwise.cpp",
        "cpu_gemm.cpp",
        "cpu_int4.cpp",
        "cpu_lora.cpp",
    )
]


@functools.cache
def source_digest() -> str:
    """A digest of the kernels' sources (and their header): in the backend timings'
    cache key, so that timings taken with other kernels are not reused after an
    update that changes them without changing a version."""
    digest = hashlib.sha256()
    for path in sorted([*SOURCES, *CSRC.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


_lock = threading.Lock()
_loaded = False
_build_error: str | None = None


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
    """Why the kernels cannot be built here, known without running anything: no
    build target for this machine, or missing tools. A failed build is
    ``load()``'s error (the backends' ``build()``), so that each backend that
    needs the kernels is passed over with it."""
    reasons = [] if cpu_isa.build_target() is not None else [cpu_isa.no_target_reason()]
    return reasons + missing_tools()


KERNEL_DTYPES = ("float32", "bfloat16", "float16")  # what every op of the library dispatches on


def query_reasons(query: KernelQuery) -> list[str]:
    """Why a backend built on these kernels cannot serve ``query`` for its device
    or dtype (the backends add their own reasons and :func:`unavailable_reasons`)."""
    reasons = []
    if query.device != "cpu":
        reasons.append(f"a CPU kernel; device is {query.device}")
    if str(query.dtype).removeprefix("torch.") not in KERNEL_DTYPES:
        reasons.append(f"dtype {query.dtype} is not float32, bfloat16 or float16")
    return reasons


def extension_name() -> str:
    """One build per target (cpu_isa.build_target)."""
    target = cpu_isa.build_target()
    return f"radixserve_cpu_kernels_{target.name if target is not None else 'no_target'}"


def build_directory() -> Path:
    """Where torch's extension builder keeps this target's build: ``$TORCH_EXTENSIONS_DIR``
    or its default root, as it names them for a CPU build of torch."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        cpp_extension.get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    )
    return Path(root) / extension_name()


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One process at a time builds or loads a target, and a build killed half-way
    does not stop every later start. Torch's builder guards its directory with a lock
    *file* (``lock``), which a process killed during its build (Ctrl-C in the first
    ``radixserve serve``) leaves behind; torch then waits on it forever, silently.
    This lock is an flock, which the kernel drops when its holder dies, so whoever
    holds it knows that a torch lock file in the directory has no live owner."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "radixserve-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build of the CPU kernels that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


def load() -> None:
    """Build (first use on this machine) or load the library; once per process."""
    global _loaded, _build_error
    with _lock:
        if _loaded:
            return
        if _build_error is not None:
            raise KernelBuildError(_build_error)
        target = cpu_isa.build_target()
        if target is None:
            raise KernelBuildError(cpu_isa.no_target_reason())
        from torch.utils import cpp_extension

        logger.info("loading the CPU kernels for %s (compiled on first use on this machine)", target.origin)
        start = time.perf_counter()
        directory = build_directory()
        try:
            with _build_lock(directory):
                library = cpp_extension.load(
                    name=extension_name(),
                    sources=[str(s) for s in SOURCES],
                    extra_cflags=["-O3", *target.cflags, "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    is_python_module=False,
                    verbose=False,
                )
        except Exception as exc:  # the compiler's output is in the exception text
            _build_error = f"building the CPU kernels failed: {_first_error_line(str(exc))}"
            raise KernelBuildError(_build_error) from exc
        _loaded = True
        amx = cpu_isa.amx_allowed()
        uses_amx = torch.ops.radixserve_cpu_gemm.set_amx(amx.allowed)
        logger.info(
            "CPU kernels ready in %.1f s (%s); AMX tiles for bfloat16 GEMMs: %s",
            time.perf_counter() - start,
            library,
            "yes" if uses_amx else f"no ({amx.reason if not amx.allowed else 'Linux refused the tile state'})",
        )


def uses_amx() -> bool:
    """Whether the loaded kernels' bfloat16 GEMMs run on AMX tiles in this process."""
    load()
    return bool(torch.ops.radixserve_cpu_gemm.uses_amx())


def _first_error_line(text: str) -> str:
    """The compiler's first ``file:line:col: error: ...`` line, else the first line
    mentioning an error, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in (": error:", "error"):
        for line in lines:
            if pattern in line.lower():
                return line
    return lines[-1] if lines else "no compiler output"
