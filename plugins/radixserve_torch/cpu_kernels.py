"""The C++ kernels of the CPU backends (csrc/): loaded from the installation, or
built once per machine and build target.

``cpu_paged`` attention, ``cpu_fused`` elementwise ops and the ``cpu_packed`` GEMM
live in one library. ``setup.py`` compiles it into the installation for each target
``cpu_isa.SHIPPED`` names (AMX, AVX512-BF16, AVX-512, AVX2 on x86-64), and
:func:`load` loads the one :func:`cpu_isa.build_target` picks for this CPU: a first
start needs no compiler. A target the installation holds no library for (``-march=native``
under ``RADIXSERVE_CPU_KERNELS=native``, the x86-64 baseline under
``ATEN_CPU_CAPABILITY=default``, an installation built without torch, sources edited
since the install) is compiled on first use with ``torch.utils.cpp_extension.load`` (g++
``-O3 -fopenmp`` and the target's instruction-set flags; ninja compiles the sources in
parallel: 10-40 s of CPU) into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions/<python>_cpu/radixserve_cpu_kernels_<target>``), so
later processes only load it; the log says which and why. It registers
``torch.ops.radixserve_cpu_paged``, ``torch.ops.radixserve_cpu_elementwise``,
``torch.ops.radixserve_cpu_gemm``, ``torch.ops.radixserve_cpu_int4`` and
``torch.ops.radixserve_cpu_lora``.

A build or load failure raises :class:`KernelBuildError` with the compiler's first
error line (or the loader's) and is remembered for the process (``load()`` raises it
again at once); the backends' ``build()`` calls ``load()``, so ``auto`` passes over
each of them with that line. :func:`unavailable_reasons` names a missing compiler or
ninja without running anything, where the installation has no library to load.
"""

from __future__ import annotations

import contextlib
import fcntl
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
from radixserve_torch.cpu_kernel_build import CFLAGS, LDFLAGS, SOURCES, installed_library

if TYPE_CHECKING:
    from collections.abc import Iterator

    from radixserve.kernels import KernelQuery

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: str | None = None  # the library's path, once loaded
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
    target = cpu_isa.build_target()
    if target is None:
        return [cpu_isa.no_target_reason(), *missing_tools()]
    return [] if installed_library(target.name, target.cflags) is not None else missing_tools()


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


def extension_name(target: cpu_isa.BuildTarget | None = None) -> str:
    """The name of a first-use build: one per target (by default this process's, cpu_isa.build_target)."""
    target = target or cpu_isa.build_target()
    return f"radixserve_cpu_kernels_{target.name if target is not None else 'no_target'}"


def build_directory(target: cpu_isa.BuildTarget | None = None) -> Path:
    """Where torch's extension builder keeps a target's first-use build: ``$TORCH_EXTENSIONS_DIR``
    or its default root, as it names them for a CPU build of torch."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        cpp_extension.get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    )
    return Path(root) / extension_name(target)


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
    """Load the installation's library for this process's target, else build it (first
    use on this machine) or load that build; once per process."""
    global _loaded, _build_error
    with _lock:
        if _loaded:
            return
        if _build_error is not None:
            raise KernelBuildError(_build_error)
        target = cpu_isa.build_target()
        if target is None:
            raise KernelBuildError(cpu_isa.no_target_reason())
        start = time.perf_counter()
        installed = installed_library(target.name, target.cflags)
        if installed is not None:
            try:
                torch.ops.load_library(str(installed))  # type: ignore[no-untyped-call]
            except OSError as exc:
                _build_error = f"loading the installed CPU kernels {installed} failed: {exc}"
                raise KernelBuildError(_build_error) from exc
            library = str(installed)
        else:
            if target.shipped:
                logger.warning(
                    "the installation holds no CPU kernels for %s built from these sources for torch %s "
                    "(installed without building them, or csrc/ changed since); compiling them now, once",
                    target.origin,
                    torch.__version__,
                )
            library = _build(target)
        _loaded = library
        amx = cpu_isa.amx_allowed()
        uses_amx = torch.ops.radixserve_cpu_gemm.set_amx(amx.allowed)
        logger.info(
            "CPU kernels for %s ready in %.1f s (%s); AMX tiles for bfloat16 GEMMs: %s",
            target.origin,
            time.perf_counter() - start,
            library,
            "yes" if uses_amx else f"no ({amx.reason if not amx.allowed else 'Linux refused the tile state'})",
        )


def _build(target: cpu_isa.BuildTarget) -> str:
    """Compile the library for ``target`` (or load torch's cached build of it); its path."""
    global _build_error
    from torch.utils import cpp_extension

    logger.info("loading the CPU kernels for %s from torch's extension cache (compiled on first use)", target.origin)
    directory, name = build_directory(target), extension_name(target)
    try:
        with _build_lock(directory):
            cpp_extension.load(
                name=name,
                sources=[str(s) for s in SOURCES],
                extra_cflags=[*CFLAGS, *target.cflags],
                extra_ldflags=list(LDFLAGS),
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # the compiler's output is in the exception text
        _build_error = f"building the CPU kernels failed: {_first_error_line(str(exc))}"
        raise KernelBuildError(_build_error) from exc
    return str(directory / f"{name}.so")


def loaded_library() -> str:
    """The path of the library this process loaded (loading it first)."""
    load()
    assert _loaded is not None
    return _loaded


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
