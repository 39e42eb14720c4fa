"""The CPU kernels' build target follows the CPU and ATen's CPU capability (cpu_isa.py).

At the CPU's own level the installation's best compiled target the CPU runs is
loaded (``-march=native``, compiled on first use, with ``RADIXSERVE_CPU_KERNELS=native``);
under ``ATEN_CPU_CAPABILITY=avx2`` (with ``ONEDNN_MAX_CPU_ISA=AVX2``: what an
AVX2-only Xeon runs) the installation's x86-64-v3 library. Under that cap ``auto``
passes over ``cpu_packed`` in bfloat16 (its kernels there are AVX512-BF16) and
``onednn`` in bfloat16, each saying why; ``cpu_packed`` serves float32 with its AVX2
kernels (16-bit weights stored as such where exact); the backends it picks pass the
conformance kit; a bfloat16 checkpoint is served in float32; and a model generates
the same greedy tokens as on the native build."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from generation_utils import generate, make_scheduler, mixed_prompts

from radixserve.kernels import KernelQuery
from radixserve.registry import get_registry
from radixserve.testing import ATTENTION_CASES, ELEMENTWISE_CASES, GEMM_CASES
from radixserve_torch import cpu_isa, cpu_kernels
from radixserve_torch.cpu_kernel_build import installed_library
from radixserve_torch.gemm import CpuPackedGemm

TESTS = Path(__file__).resolve().parent
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
FORCED = dict(attention_backend="cpu_paged", elementwise_backend="cpu_fused", gemm_backend="onednn")
QUERY = dict(device="cpu", head_dim=64, num_heads=4, num_kv_heads=2)


# /proc/cpuinfo's flags of three classes (the x86-64-v4 level and what each adds).
SKYLAKE_SP = cpu_isa.X86_64_V4 | {"avx512_vnni"}
ZEN4 = cpu_isa.X86_64_V4 | {"avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8", "avx512_fp16"}
HASWELL = cpu_isa.X86_64_V3


def test_target_table():
    # At the CPU's own level: the best compiled target it runs, each its own library.
    shipped = {
        flags_name: cpu_isa.select_target("x86_64", "AVX512", False, flags)
        for flags_name, flags in (("spr", SAPPHIRE_RAPIDS), ("zen4", ZEN4), ("skx", SKYLAKE_SP), ("hsw", HASWELL))
    }
    assert {k: t.name for k, t in shipped.items()} == {
        "spr": "x86_64_amx",
        "zen4": "x86_64_avx512_bf16",
        "skx": "x86_64_avx512",
        "hsw": "x86_64_avx2",
    }
    assert all(t.shipped for t in shipped.values())
    assert [t.name for t in cpu_isa.shipped_targets("x86_64")] == [t.name for t in shipped.values()]
    assert {"amx_bf16", "amx_tile", "avx512_bf16"} <= shipped["spr"].features <= SAPPHIRE_RAPIDS
    assert "-mamx-bf16" in shipped["spr"].cflags and "-mavx512bf16" in shipped["zen4"].cflags
    assert "avx512_bf16" not in shipped["skx"].features and shipped["hsw"].cflags == ("-march=x86-64-v3",)
    # An installation without the AMX library (a compiler too old for it): the next class's;
    # one without any (sources edited since): the best, compiled on first use.
    no_amx = cpu_isa.select_target("x86_64", "AVX512", False, SAPPHIRE_RAPIDS, installed=lambda t: "amx" not in t.name)
    none = cpu_isa.select_target("x86_64", "AVX512", False, SAPPHIRE_RAPIDS, installed=lambda t: False)
    assert (no_amx.name, none.name) == ("x86_64_avx512_bf16", "x86_64_amx")
    # Compiled for this CPU on first use: asked for, or where no compiled target fits.
    flags = frozenset({"avx2", "avx512f", "avx512_bf16"})
    asked = cpu_isa.select_target("x86_64", "AVX512", False, SAPPHIRE_RAPIDS, native=True)
    unfitting = cpu_isa.select_target("x86_64", "AVX512", False, flags)
    for native in (asked, unfitting):
        assert native.cflags == ("-march=native",) and not native.shipped
    assert unfitting.features == flags
    # Under a cap: the capped level's target, compiled into the installation but for the baseline.
    avx2 = cpu_isa.select_target("x86_64", "AVX2", True, flags)
    assert avx2.cflags == ("-march=x86-64-v3",) and "avx2" in avx2.features and "avx512f" not in avx2.features
    capped512 = cpu_isa.select_target("x86_64", "AVX512", True, SAPPHIRE_RAPIDS)
    assert capped512.cflags == ("-march=x86-64-v4",) and "avx512_bf16" not in capped512.features
    baseline = cpu_isa.select_target("x86_64", "DEFAULT", True, flags)
    assert baseline.cflags == ("-march=x86-64",) and "avx" not in baseline.features
    assert (avx2.name, avx2.shipped) == ("x86_64_avx2", True)
    assert (capped512.name, capped512.shipped, baseline.shipped) == ("x86_64_avx512", True, False)
    # No entry for another architecture yet: no kernels, and the backends say so.
    assert cpu_isa.select_target("aarch64", "DEFAULT", False, frozenset()) is None


def test_the_kernels_setting_is_checked(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CPU_KERNELS", "fastest")
    with pytest.raises(ValueError, match="RADIXSERVE_CPU_KERNELS='fastest': expected 'installed'"):
        cpu_isa.native_requested()
    monkeypatch.setenv("RADIXSERVE_CPU_KERNELS", "Native")
    assert cpu_isa.native_requested()


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("objdump"), reason="x86-64 with objdump")
def test_the_installation_holds_each_target_compiled_with_its_instructions():
    """setup.py's libraries, disassembled: each uses its class's instructions and none
    above them (an AVX2 CPU must not meet an AVX-512 one, an AVX-512 CPU a BF16 one)."""
    used = {}
    for target in cpu_isa.shipped_targets("x86_64"):
        library = installed_library(target.name, target.cflags)
        assert library is not None, f"no library for {target.name}: install with the README's command"
        listing = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True).stdout
        used[target.name.removeprefix("x86_64_")] = [
            marker in listing for marker in ("%ymm", "%zmm", "vdpbf16ps", "tdpbf16ps")
        ]
    assert used == {
        "amx": [True, True, True, True],
        "avx512_bf16": [True, True, True, False],
        "avx512": [True, True, False, False],
        "avx2": [True, False, False, False],
    }


def test_this_process_loads_the_installations_library_for_its_cpu():
    target = cpu_isa.build_target()
    if target is None:
        pytest.skip(cpu_isa.no_target_reason())
    if platform.machine() == "x86_64" and not os.environ.get("ATEN_CPU_CAPABILITY"):
        if os.environ.get("RADIXSERVE_CPU_KERNELS", "").lower() == "native":
            assert target.cflags == ("-march=native",)
        else:
            best = next(t for t in cpu_isa.shipped_targets("x86_64") if t.features <= (cpu_isa.cpu_flags() or set()))
            assert target == best
            assert cpu_kernels.loaded_library() == str(installed_library(target.name, target.cflags))
    assert cpu_kernels.extension_name() == f"radixserve_cpu_kernels_{target.name}"


def test_cpu_packed_serves_float32_alone_on_an_avx2_build(monkeypatch):
    avx2 = cpu_isa.select_target("x86_64", "AVX2", True, frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(cpu_isa, "build_target", lambda: avx2)
    assert CpuPackedGemm.unsupported_reasons(KernelQuery(dtype=torch.float32, **QUERY)) == []
    assert CpuPackedGemm.unsupported_reasons(KernelQuery(dtype=torch.bfloat16, **QUERY)) == [
        "its torch.bfloat16 kernels need avx512_bf16, and the CPU kernels are built for AVX2 "
        "(-march=x86-64-v3; ATEN_CPU_CAPABILITY caps ATen at AVX2), which lacks it"
    ]
    baseline = cpu_isa.select_target("x86_64", "DEFAULT", True, frozenset({"avx2", "avx512f"}))
    monkeypatch.setattr(cpu_isa, "build_target", lambda: baseline)
    assert CpuPackedGemm.unsupported_reasons(KernelQuery(dtype=torch.float32, **QUERY)) == [
        "its torch.float32 kernels need avx512f or avx2 + f16c + fma, and the CPU kernels are built for DEFAULT "
        "(-march=x86-64; ATEN_CPU_CAPABILITY caps ATen at DEFAULT), which lacks it"
    ]


def test_no_target_means_no_kernels(monkeypatch):
    monkeypatch.setattr(cpu_isa, "build_target", lambda: None)
    query = KernelQuery(dtype=torch.float32, **QUERY)
    reason = cpu_isa.no_target_reason()
    assert "no build target for" in reason and reason in cpu_kernels.unavailable_reasons()
    assert get_registry().select("attention", query).name == "torch_varlen"
    assert get_registry().select("elementwise", query).name == "torch_native"


# What the capped subprocess runs: selection, reasons, the kits on what auto picks,
# the dtype auto gives a bfloat16 checkpoint, and a generation; one JSON line out.
CAPPED_RUN = textwrap.dedent("""
    import json, sys
    import torch
    from generation_utils import generate, make_scheduler, mixed_prompts
    from radixserve.kernels import KernelQuery
    from radixserve.registry import get_registry
    from radixserve.testing import check_attention_backend, check_elementwise_backend, check_gemm_backend
    from radixserve_torch import cpu_kernels
    from radixserve_torch.gemm import CpuPackedGemm, OneDnnGemm
    from radixserve_torch.platform import CpuPlatform

    kits = {"attention": check_attention_backend, "gemm": check_gemm_backend,
            "elementwise": check_elementwise_backend}
    out = {"capability": torch.backends.cpu.get_cpu_capability(), "library": cpu_kernels.loaded_library(),
           "selected": {}, "reasons": {}, "cases": {}}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        query = KernelQuery(dtype=dtype, **json.loads(sys.argv[2]))
        out["selected"][name] = {kind: get_registry().select(kind, query).name for kind in kits}
        out["reasons"][name] = {"cpu_packed": CpuPackedGemm.unsupported_reasons(query),
                                "onednn": OneDnnGemm.unsupported_reasons(query)}
        for kind, backend in out["selected"][name].items():
            report = kits[kind](backend, dtypes=[dtype]).raise_for_failures()
            out["cases"][f"{kind} {backend} {name}"] = len(report.results)
    # cpu_packed's AVX2 kernels on float32 weights that bfloat16 or float16 hold exactly
    # (stored so: half the bytes) and on others, plain and with silu(gate) * up fused.
    gemm, gen, out["packed"] = CpuPackedGemm(KernelQuery(dtype=torch.float32, **json.loads(sys.argv[2]))), \
        torch.Generator().manual_seed(0), {}
    for narrow in (torch.bfloat16, torch.float16, torch.float32):
        w = (torch.randn(96, 64, generator=gen) / 8).to(narrow).float()
        packed, errors = gemm.prepare_weight(w), []
        for rows in (1, 3, 8, 13):  # a tile of one row, of three, and the widened copy from eight
            x = torch.randn(rows, 64, generator=gen)
            full = x.double() @ w.double().t()
            gated = torch.nn.functional.silu(full[:, :48]) * full[:, 48:]
            errors.append((gemm.linear(x, packed).double() - full).abs().max().item())
            errors.append((gemm.linear_silu_and_mul(x, packed).double() - gated).abs().max().item())
        out["packed"][str(narrow)] = [str(packed.dtype), max(errors)]
    choice = CpuPlatform.auto_dtype(torch.bfloat16)
    out["auto_dtype"] = [str(choice.dtype), choice.reason]
    scheduler = make_scheduler(sys.argv[1], **json.loads(sys.argv[3]))
    out["dtype"] = scheduler.runner.summary()["dtype"]
    out["tokens"] = [r.output_ids for r in generate(scheduler, mixed_prompts(512, [7, 40, 19], seed=5),
                                                    max_new_tokens=12, ignore_eos=True)]
    print(json.dumps(out))
""")


@pytest.mark.skipif(
    platform.machine() != "x86_64" or "avx2" not in (cpu_isa.cpu_flags() or ()), reason="needs an x86-64 CPU with AVX2"
)
def test_avx2_caps_pick_working_backends_and_generate_as_the_native_build(tiny_model_factory):
    model_dir = tiny_model_factory(dtype="bfloat16", seed=3)
    env = {**os.environ, **AVX2_CAPS, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    # dtype auto: the bfloat16 checkpoint runs in float32 under the caps (no native bfloat16 left).
    proc = subprocess.run(
        [sys.executable, "-c", CAPPED_RUN, str(model_dir), json.dumps(QUERY), json.dumps({**FORCED, "dtype": "auto"})],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    # The installation's AVX2 library, compiled by setup.py: nothing is compiled here.
    avx2 = cpu_isa.select_target("x86_64", "AVX2", True, cpu_isa.cpu_flags())
    assert out["capability"] == "AVX2" and out["library"] == str(installed_library(avx2.name, avx2.cflags))
    assert out["selected"] == {
        "float32": {"attention": "cpu_paged", "gemm": "cpu_packed", "elementwise": "cpu_fused"},
        "bfloat16": {"attention": "cpu_paged", "gemm": "torch", "elementwise": "cpu_fused"},
    }
    assert out["reasons"]["float32"]["cpu_packed"] == []
    cpu_packed_bf16 = out["reasons"]["bfloat16"]["cpu_packed"]
    assert len(cpu_packed_bf16) == 1 and "need avx512_bf16" in cpu_packed_bf16[0] and "x86-64-v3" in cpu_packed_bf16[0]
    for narrow, (stored, error) in out["packed"].items():
        assert stored == narrow and error < 1e-5, out["packed"]
    flags = cpu_isa.cpu_flags() or frozenset()
    if {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags:  # the cap, not the CPU
        why = "ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN from the AVX-512 (or AVX-NE-CONVERT) its bfloat16 needs"
    else:
        why = "this CPU lacks the AVX-512 (or AVX-NE-CONVERT) oneDNN needs for bfloat16"
    assert out["reasons"]["bfloat16"]["onednn"] == [why]
    print(json.dumps(out["cases"], indent=1))
    # One dtype each: every standard case, but the fused silu_and_mul GEMM ones where the
    # backend has none (only cpu_packed has them).
    attention, elementwise = len(ATTENTION_CASES["standard"]), len(ELEMENTWISE_CASES["standard"])
    unfused = sum(not c.silu_and_mul for c in GEMM_CASES["standard"])
    assert out["cases"] == {
        f"{kind} {backend} {dtype}": n
        for dtype, gemm_backend, gemm in (
            ("float32", "cpu_packed", len(GEMM_CASES["standard"])),
            ("bfloat16", "torch", unfused),
        )
        for kind, backend, n in (
            ("attention", "cpu_paged", attention),
            ("gemm", gemm_backend, gemm),
            ("elementwise", "cpu_fused", elementwise),
        )
    }
    if "avx512_bf16" in (cpu_isa.cpu_flags() or ()):
        assert out["auto_dtype"][0] == "torch.float32" and "ONEDNN_MAX_CPU_ISA=AVX2" in out["auto_dtype"][1]
    assert out["dtype"] == "float32"

    if shutil.which("objdump"):
        listing = subprocess.run(["objdump", "-d", out["library"]], capture_output=True, text=True).stdout
        assert "%ymm" in listing and "%zmm" not in listing  # AVX2 vectors, no AVX-512 instruction

    # The native build, float32 as well: the same greedy tokens.
    native = make_scheduler(model_dir, dtype="float32", **FORCED)
    want = [
        r.output_ids
        for r in generate(native, mixed_prompts(512, [7, 40, 19], seed=5), max_new_tokens=12, ignore_eos=True)
    ]
    assert out["tokens"] == want
