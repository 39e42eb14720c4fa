"""The instruction sets the CPU backends may use in this process.

Three things bound them: the CPU (its ``/proc/cpuinfo`` flags); ATen's CPU
capability (``torch.backends.cpu.get_cpu_capability()``: the CPU's top level,
or a lower one where ``ATEN_CPU_CAPABILITY`` caps it), which our C++ kernels
(csrc/) follow; and ``ONEDNN_MAX_CPU_ISA``, which caps oneDNN (the ``onednn``
GEMM and torch's own bfloat16 matmuls). So ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 machine runs what an AVX2-only Xeon runs.

:func:`build_target` is the one place that decides what the kernels are compiled
for. At the CPU's own level (no ``ATEN_CPU_CAPABILITY``) that is the CPU itself
(``-march=native``: every extension it has, tuned for it); under a cap, the
explicit target of the capped level from :data:`CAPPED_TARGETS`. Both tables
are keyed by ``platform.machine()``, so another architecture (aarch64: NEON,
SVE) is its own entries; one without entries gets no kernels, and the backends
that need them say so.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch


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

    name: str  # part of the extension's name, so that builds for different targets coexist in torch's cache
    cflags: tuple[str, ...]  # the compiler flags that choose the instruction set
    features: frozenset[str]  # the extensions the compiled kernels may use, named as /proc/cpuinfo names them
    origin: str  # what it is and why, for messages


# The x86-64 micro-architecture levels (psABI), in /proc/cpuinfo's names.
X86_64 = frozenset({"sse", "sse2"})
X86_64_V2 = X86_64 | {"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16"}
X86_64_V3 = X86_64_V2 | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# The CPU's own level, per architecture: everything it has, tuned for it.
NATIVE_FLAGS: dict[str, tuple[str, ...]] = {
    "x86_64": ("-march=native",),
}
# A capped ATen capability, per (architecture, capability): an explicit target,
# the level that ATen's own kernels of that capability are compiled for.
CAPPED_TARGETS: dict[tuple[str, str], tuple[tuple[str, ...], frozenset[str]]] = {
    ("x86_64", "AVX512"): (("-march=x86-64-v4",), X86_64_V4),
    ("x86_64", "AVX2"): (("-march=x86-64-v3",), X86_64_V3),
    ("x86_64", "DEFAULT"): (("-march=x86-64",), X86_64),
}


def select_target(machine: str, capability: str, capped: bool, flags: frozenset[str] | None) -> BuildTarget | None:
    """The build target for ATen ``capability`` on ``machine`` (``capped``: set by
    ``ATEN_CPU_CAPABILITY``; ``flags``: the CPU's), or None where there is none."""
    level = capability.upper()
    if not capped and machine in NATIVE_FLAGS:
        cflags = NATIVE_FLAGS[machine]
        return BuildTarget(
            f"{machine}_{level.lower()}_native", cflags, flags or frozenset(), f"this CPU ({' '.join(cflags)})"
        )
    if (machine, level) in CAPPED_TARGETS:
        cflags, features = CAPPED_TARGETS[(machine, level)]
        return BuildTarget(
            f"{machine}_{level.lower()}",
            cflags,
            features,
            f"{level} ({' '.join(cflags)}; ATEN_CPU_CAPABILITY caps ATen at {level})",
        )
    return None


def aten_capability_capped() -> bool:
    """Whether ``ATEN_CPU_CAPABILITY`` chose ATen's capability (rather than ATen detecting the CPU's)."""
    return bool(os.environ.get("ATEN_CPU_CAPABILITY"))


@functools.cache
def build_target() -> BuildTarget | None:
    """This process's build target (ATen reads its capability once per process, so this is cached)."""
    return select_target(
        platform.machine(), torch.backends.cpu.get_cpu_capability(), aten_capability_capped(), cpu_flags()
    )


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
    """AMX for our kernels where the build target has AMX-BF16 (the CPU's own level:
    ``-march=native`` on a CPU with it) and ``ONEDNN_MAX_CPU_ISA``, if set, names an
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
