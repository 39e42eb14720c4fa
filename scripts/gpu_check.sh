#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: install the CUDA platform plugin,
# run the GPU-marked tests (conformance kit + end-to-end generation on cuda) and
# time the Triton kernels against the torch reference.
#   bash scripts/gpu_check.sh            (from the repository root)
set -euo pipefail
python -m pip install -q -e ".[dev]" -e hardware/cuda
python -m pytest -q -m cuda -rs tests/test_cuda.py
python benchmarks/bench_kernels.py --device cuda
