"""Compiles the CPU kernels (plugins/radixserve_torch/csrc) into the installation.

One library per target that ``radixserve_torch/cpu_isa.py`` ships for this machine's
architecture (on x86-64: AMX, AVX512-BF16, AVX-512, AVX2), so that a first start
needs no compiler: ``cpu_kernels.load`` loads the best one the CPU runs. The
libraries link against the torch this build imports, so build with the torch you
run: ``pip install --no-build-isolation -e .`` (README). Where the build has no
torch (pip's isolated build environment), nothing is compiled here and the kernels
are compiled on first use, as the server's log says. The package's metadata is in
pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "plugins" / "radixserve_torch"


def load_standalone(name: str) -> ModuleType:
    """A module of radixserve_torch that imports only the standard library and torch,
    loaded without importing the package (whose ``__init__`` needs radixserve)."""
    spec = importlib.util.spec_from_file_location(f"_radixserve_setup_{name}", PACKAGE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def compiler_accepts(cflags: tuple[str, ...]) -> bool:
    """Whether the C++ compiler (``$CXX``, else ``c++``, as torch's builder uses) knows
    these flags (GCC learned AMX's in version 11)."""
    compiler = os.environ.get("CXX", "c++")
    try:
        probe = subprocess.run(
            [compiler, *cflags, "-x", "c++", "-fsyntax-only", "-"],
            input="int main() {}\n",
            capture_output=True,
            text=True,
        )
    except OSError:
        return False
    return probe.returncode == 0


def kernel_extensions() -> tuple[list, dict]:
    """The kernels' extensions and the build command that compiles them, or none
    where this build environment has no torch."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("setup.py: no torch in this build environment; the CPU kernels compile on first use", file=sys.stderr)
        return [], {}
    build = load_standalone("cpu_kernel_build")
    isa = load_standalone("cpu_isa")
    extensions, stems = [], set()
    for target in isa.shipped_targets(platform.machine()):
        if not compiler_accepts(target.cflags):
            print(
                f"setup.py: the C++ compiler rejects {' '.join(target.cflags)}: no {target.name} kernels "
                "(too old for them?); CPUs of that class load the next class's",
                file=sys.stderr,
            )
            continue
        stem = build.library_stem(target.name, target.cflags)
        stems.add(stem)
        extensions.append(
            CppExtension(
                f"radixserve_torch.{stem}",
                [str(source.relative_to(ROOT)) for source in build.SOURCES],
                extra_compile_args=[*build.CFLAGS, *target.cflags, "-g0"],
                extra_link_args=list(build.LDFLAGS),
            )
        )
    # Libraries left in the source tree by an editable install of older sources.
    for old in PACKAGE.glob(f"{build.LIBRARY_PREFIX}*"):
        if old.name.split(".", 1)[0] not in stems:
            old.unlink()

    class BuildKernels(BuildExtension):
        """Reuses a library an editable install already compiled in place from the same
        sources, flags and torch (the name says which), so that installing again is quick."""

        def build_extension(self, ext: Extension) -> None:
            output = Path(self.get_ext_fullpath(ext.name))
            in_place = PACKAGE / output.name
            if in_place.is_file() and in_place.resolve() != output.resolve():
                output.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(in_place, output)
                return
            super().build_extension(ext)

    return extensions, {"build_ext": BuildKernels.with_options(use_ninja=True)}


extensions, commands = kernel_extensions()
setup(ext_modules=extensions, cmdclass=commands)
