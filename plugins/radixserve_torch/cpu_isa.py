"""The instruction sets the CPU backends may use in this process.

Three things bound them: the CPU (its ``/proc/cpuinfo`` flags); ATen's CPU
capability (``torch.backends.cpu.get_cpu_capability()``: the CPU's top level,
or a lower one where ``ATEN_CPU_CAPABILITY`` caps it), which our C++ kernels
(csrc/) follow; and ``ONEDNN_MAX_CPU_ISA``, which caps oneDNN (the ``onednn``
GEMM and torch's own bfloat16 matmuls). So ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 machine runs what an AVX2-only Xeon runs.

:func:`build_target` is the one place that decides what the kernels are compiled
for. At the CPU's own level (no ``ATEN_CPU_CAPABILITY``) that is the best of the
targets the installation ships compiled (:data:`SHIPPED`: ``setup.py`` builds one
library for each) that the CPU runs; with ``RADIXSERVE_CPU_KERNELS=native``, or on a
CPU none of them fits, the CPU itself (``-march=native``: every extension it has,
tuned for it), compiled on first use. Under a cap, the explicit target of the capped
level (:data:`CAPPED`). The tables are keyed by ``platform.machine()``, so another
architecture (aarch64: NEON, SVE) is its own entries; one without entries gets no
kernels, and the backends that need them say so.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` (Linux, x86), or None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return frozenset()


@functools.cache
def cpu_model_name() -> str:
    """``/proc/cpuinfo``'s model name (x86; ``unknown`` where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


@dataclass(frozen=True)
class BuildTarget:
    """What the C++ kernels are compiled for."""

    name: str  # part of the library's name, so that builds for different targets coexist
    cflags: tuple[str, ...]  # the compiler flags that choose the instruction set
    features: frozenset[str]  # the extensions the compiled kernels may use, named as /proc/cpuinfo names them
    origin: str  # what it is and why, for messages
    shipped: bool = False  # compiled into the installation by setup.py (else on first use)


# The x86-64 micro-architecture levels (psABI), in /proc/cpuinfo's names.
X86_64 = frozenset({"sse", "sse2"})
X86_64_V2 = X86_64 | {"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16"}
X86_64_V3 = X86_64_V2 | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class TargetSpec:
    """A named explicit target: its compiler flags and the extensions they allow."""

    cflags: tuple[str, ...]
    features: frozenset[str]


# The explicit targets, per architecture. The kernels' code paths follow the
# compiler's macros (__AVX2__, __AVX512F__, __AVX512BF16__, __AMX_BF16__), so these
# four are the classes with different kernels: AMX (Intel Sapphire Rapids and later),
# AVX512-BF16 without AMX (AMD Zen 4 and 5, Intel Cooper Lake), AVX-512 without BF16
# (Intel Skylake-SP to Ice Lake), AVX2 (AMD Zen 1-3, Intel Haswell to Comet Lake).
TARGETS: dict[str, dict[str, TargetSpec]] = {
    "x86_64": {
        "amx": TargetSpec(
            ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mtune=sapphirerapids"),
            X86_64_V4 | {"avx512_bf16", "amx_tile", "amx_bf16"},
        ),
        "avx512_bf16": TargetSpec(("-march=x86-64-v4", "-mavx512bf16"), X86_64_V4 | {"avx512_bf16"}),
        "avx512": TargetSpec(("-march=x86-64-v4",), X86_64_V4),
        "avx2": TargetSpec(("-march=x86-64-v3",), X86_64_V3),
        "default": TargetSpec(("-march=x86-64",), X86_64),
    },
}
# What setup.py compiles into the installation, best first: the first the CPU runs is used.
SHIPPED: dict[str, tuple[str, ...]] = {"x86_64": ("amx", "avx512_bf16", "avx512", "avx2")}
# ATen's capability capped by ATEN_CPU_CAPABILITY, per architecture: the target that
# ATen's own kernels of that capability are compiled for.
CAPPED: dict[tuple[str, str], str] = {
    ("x86_64", "AVX512"): "avx512",
    ("x86_64", "AVX2"): "avx2",
    ("x86_64", "DEFAULT"): "default",
}
# The CPU's own level, per architecture: everything it has, tuned for it (compiled on first use).
NATIVE_FLAGS: dict[str, tuple[str, ...]] = {
    "x86_64": ("-march=native",),
}


def shipped_targets(machine: str) -> list[BuildTarget]:
    """The targets setup.py compiles for ``machine``, best first."""
    return [
        _explicit(machine, name, "compiled into the installation", shipped=True) for name in SHIPPED.get(machine, ())
    ]


def _explicit(machine: str, name: str, why: str, shipped: bool) -> BuildTarget:
    spec = TARGETS[machine][name]
    return BuildTarget(
        f"{machine}_{name}", spec.cflags, spec.features, f"{name.upper()} ({' '.join(spec.cflags)}; {why})", shipped
    )


def select_target(
    machine: str,
    capability: str,
    capped: bool,
    flags: frozenset[str] | None,
    native: bool = False,
    installed: Callable[[BuildTarget], bool] = lambda target: True,
) -> BuildTarget | None:
    """The build target for ATen ``capability`` on ``machine`` (``capped``: set by
    ``ATEN_CPU_CAPABILITY``; ``flags``: the CPU's; ``native``: compile for this CPU
    on first use rather than load a shipped target), or None where there is none.
    Of the shipped targets the CPU runs, the best that is ``installed`` (a compiler
    too old for AMX leaves that one out of the installation), else the best (then
    compiled on first use: the sources changed since the install, or it built none)."""
    level = capability.upper()
    if capped:
        if (machine, level) not in CAPPED:
            return None
        name = CAPPED[(machine, level)]
        why = f"ATEN_CPU_CAPABILITY caps ATen at {level}"
        return _explicit(machine, name, why, shipped=name in SHIPPED.get(machine, ()))
    if not native:
        runnable = [t for t in shipped_targets(machine) if flags is not None and t.features <= flags]
        if runnable:
            return next((t for t in runnable if installed(t)), runnable[0])
    if machine in NATIVE_FLAGS:
        cflags = NATIVE_FLAGS[machine]
        return BuildTarget(
            f"{machine}_{level.lower()}_native", cflags, flags or frozenset(), f"this CPU ({' '.join(cflags)})"
        )
    return None


def aten_capability_capped() -> bool:
    """Whether ``ATEN_CPU_CAPABILITY`` chose ATen's capability (rather than ATen detecting the CPU's)."""
    return bool(os.environ.get("ATEN_CPU_CAPABILITY"))


KERNELS_SETTING = "RADIXSERVE_CPU_KERNELS"  # "installed" (the default) or "native"


def native_requested() -> bool:
    """Whether ``RADIXSERVE_CPU_KERNELS=native`` asks for kernels compiled for this CPU
    on first use instead of the installation's compiled ones."""
    value = os.environ.get(KERNELS_SETTING, "installed").strip().lower()
    if value not in ("installed", "native"):
        raise ValueError(f"{KERNELS_SETTING}={value!r}: expected 'installed' (the default) or 'native'")
    return value == "native"


@functools.cache
def build_target() -> BuildTarget | None:
    """This process's build target (ATen reads its capability once per process, so this is cached)."""
    # Imported here: setup.py loads this module by path, outside the package.
    from radixserve_torch.cpu_kernel_build import installed_library

    here = (platform.machine(), torch.backends.cpu.get_cpu_capability(), aten_capability_capped(), cpu_flags())
    best = select_target(*here, native_requested())
    chosen = select_target(
        *here, native_requested(), installed=lambda t: installed_library(t.name, t.cflags) is not None
    )
    if chosen != best and best is not None and chosen is not None:
        logger.warning(
            "the installation holds no CPU kernels for %s (setup.py could not compile them: its output says why); "
            "loading those for %s",
            best.origin,
            chosen.origin,
        )
    return chosen


def no_target_reason() -> str:
    """Why this process has no build target (for ``unsupported_reasons`` and errors)."""
    return (
        f"the CPU kernels have no build target for {platform.machine()} at ATen capability "
        f"{torch.backends.cpu.get_cpu_capability()} (radixserve_torch/cpu_isa.py)"
    )


# ONEDNN_MAX_CPU_ISA values below avx512_core_bf16: oneDNN may not use bfloat16 dot products.
ONEDNN_BELOW_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})


def onednn_isa_cap() -> str | None:
    """``ONEDNN_MAX_CPU_ISA`` (or its former name ``DNNL_MAX_CPU_ISA``), upper-case; None when unset."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cap.upper() if cap else None


@dataclass(frozen=True)
class Bf16Matmul:
    """Whether bfloat16 matmuls run on bfloat16 instructions here, and why (for the log)."""

    native: bool
    reason: str


def bf16_matmul() -> Bf16Matmul:
    """Native where the CPU has AVX512-BF16 or AMX-BF16 and our kernels' build target
    or oneDNN's cap lets a GEMM use them; elsewhere bfloat16 is emulated (widened to
    float32 for every product), which is slower than float32 itself."""
    has = sorted({"avx512_bf16", "amx_bf16"} & (cpu_flags() or frozenset()))
    if not has:
        return Bf16Matmul(False, "this CPU has no bfloat16 matmul instructions (avx512_bf16, amx_bf16)")
    target, cap = build_target(), onednn_isa_cap()
    if (target is not None and "avx512_bf16" in target.features) or cap not in ONEDNN_BELOW_BF16:
        return Bf16Matmul(True, f"this CPU has {' and '.join(has)}")
    built_for = target.origin if target is not None else "no target"
    return Bf16Matmul(
        False,
        f"this CPU has {' and '.join(has)}, but our kernels are built for {built_for} and "
        f"ONEDNN_MAX_CPU_ISA={cap} caps oneDNN below them",
    )


@dataclass(frozen=True)
class AmxUse:
    """Whether our kernels may run bfloat16 products on AMX tiles, and why (for the log)."""

    allowed: bool
    reason: str


def amx_allowed() -> AmxUse:
    """AMX for our kernels where the build target has AMX-BF16 (the installation's
    ``amx`` target, or ``-march=native`` on a CPU with it) and ``ONEDNN_MAX_CPU_ISA``, if set, names an
    AMX level: the setting that hides AMX from oneDNN hides it from our kernels too,
    so ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` on an AMX Xeon runs the class without
    AMX (AVX512-BF16, as AMD's Zen 4) throughout."""
    target, cap = build_target(), onednn_isa_cap()
    if target is None or not {"amx_bf16", "amx_tile"} <= target.features:
        built_for = target.origin if target is not None else "no target"
        return AmxUse(False, f"the CPU kernels are built for {built_for}, without AMX-BF16")
    if cap is not None and "AMX" not in cap and cap not in ("ALL", "DEFAULT"):
        return AmxUse(False, f"ONEDNN_MAX_CPU_ISA={cap} hides AMX")
    return AmxUse(True, "this CPU has AMX-BF16 and nothing caps it")
