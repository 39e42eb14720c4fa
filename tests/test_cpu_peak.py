"""benchmarks/cpu_peak.py end to end at a few iterations: it builds its loops with
the kernels' flags and reports a rate per dtype (the roof docs/benchmarks.md
reads the CPU figures against)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve_torch import cpu_kernels
from radixserve_torch.cpu_isa import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
FLAGS = cpu_flags() or set()


@pytest.mark.skipif(
    "avx512f" not in FLAGS or bool(cpu_kernels.missing_tools()), reason="needs AVX-512 and a C++ toolchain"
)
def test_cpu_peak_reports_both_loops_on_the_threads_asked_for():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_peak.py"), "--threads", "2", "--iterations", "2000000"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    fp32 = [line for line in lines if line.startswith("float32 (vfmadd)")]
    assert len(fp32) == 1 and re.search(r": \d+ GFLOP/s on 2 threads", fp32[0]), out.stdout
    bf16 = [line for line in lines if line.startswith("bfloat16 (vdpbf16ps)")]
    if "avx512_bf16" in FLAGS:
        assert len(bf16) == 1 and re.search(r": \d+ GFLOP/s on 2 threads", bf16[0]), out.stdout
    else:
        assert bf16 == ["bfloat16 (vdpbf16ps): not compiled for this CPU (no AVX512_BF16)"], out.stdout
