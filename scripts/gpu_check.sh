#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: install the CUDA platform plugin,
# run every GPU-marked test (conformance kits, end-to-end generation on cuda, and
# the FlashInfer backend when flashinfer is installed: pip install
# 'radixserve-plugin-cuda[flashinfer]'), time the Triton kernels against the torch
# reference, then the whole-engine GPU benchmark (docs/benchmarks.md, P6).
#   bash scripts/gpu_check.sh            (from the repository root)
set -euo pipefail
# Every plugin, as CI installs them: the ROCm and NPU test modules import their packages
# (their platforms report themselves unavailable on an NVIDIA machine).
python -m pip install -q -e ".[dev]" -e hardware/cuda -e hardware/rocm -e hardware/npu
python -m pytest -q -m cuda -rs tests/
python benchmarks/bench_kernels.py --device cuda
python benchmarks/bench_gpu.py --json --profile
