"""What the CPU kernels (csrc/) are compiled from, with which flags, and what their
compiled libraries are named.

Two builds use it: ``setup.py``, which compiles the kernels into the installation
for each target :data:`radixserve_torch.cpu_isa.SHIPPED` names, and
``cpu_kernels.load``'s build on first use, for a target the installation holds no
library for. It imports nothing but the standard library and torch, so that
``setup.py`` can load it by path before radixserve is installed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
from pathlib import Path

import torch

PACKAGE = Path(__file__).resolve().parent
CSRC = PACKAGE / "csrc"
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
CFLAGS = ("-O3", "-fopenmp")  # and the target's instruction-set flags
LDFLAGS = ("-fopenmp",)


@functools.cache
def source_digest() -> str:
    """A digest of the kernels' sources (and their headers): in the backend timings'
    cache key, so that timings taken with other kernels are not reused after an
    update that changes them without changing a version, and in the installed
    libraries' names."""
    digest = hashlib.sha256()
    for path in sorted([*SOURCES, *CSRC.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


LIBRARY_PREFIX = "_cpu_kernels_"


def library_stem(target_name: str, cflags: tuple[str, ...]) -> str:
    """The installed library's name (before the interpreter's extension suffix): the
    target's, and a digest of what it was built from (the sources, the flags, torch's
    version, whose C++ ABI it links against), so that a library built from other
    sources (``csrc/`` edited after the install) or for another torch is not found,
    rather than loaded."""
    built_from = "\0".join([source_digest(), torch.__version__, *CFLAGS, *cflags])
    return f"{LIBRARY_PREFIX}{target_name}_{hashlib.sha256(built_from.encode()).hexdigest()[:12]}"


def installed_library(target_name: str, cflags: tuple[str, ...]) -> Path | None:
    """The library ``setup.py`` compiled for this target from these sources and this
    torch, where the installation holds one."""
    stem = library_stem(target_name, cflags)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (path := PACKAGE / f"{stem}{suffix}").is_file():
            return path
    return None
