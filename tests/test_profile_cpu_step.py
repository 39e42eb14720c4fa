"""benchmarks/profile_cpu_step.py end to end on the tiny Llama: a few decode steps
profiled, each operator's share of the wall time, and the GEMMs' rate read from
their recorded shapes against the peak given."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_decode_profile_names_the_gemms_and_their_rate(tiny_llama_dir: Path, tmp_path: Path) -> None:
    command = [
        sys.executable, str(ROOT / "benchmarks" / "profile_cpu_step.py"), "--model", str(tiny_llama_dir),
        "--workload", "decode", "--batch", "4", "--steps", "3", "--peak-gflops", "1000", "--threads", "1",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"decode, float32, 1 threads: 3 steps in [\d.]+ s", out.stdout), out.stdout
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines() if "::" in line.split(" ")[0]}
    gemms = [name for name in rows if name.startswith(("radixserve_cpu_gemm::", "mkldnn::", "aten::addmm", "aten::mm"))]
    assert gemms, out.stdout
    assert all(len(rows[name]) == 5 and rows[name][4].endswith("%") for name in gemms), out.stdout
    rate = r"GEMM in all: [\d.]+ s \(([\d.]+)% of the wall\), ([\d.e+-]+) GFLOP/s = \d+% of the peak"
    total = re.search(rate, out.stdout)
    assert total and 0 < float(total[1]) < 100 and float(total[2]) > 0, out.stdout
