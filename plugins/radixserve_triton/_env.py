"""Cheap, import-free probes shared by the Triton backends' ``unsupported_reasons``,
and the one place a backend loads its kernels (``kernel_module``, when it is built).

Nothing here imports triton at import time or initialises a device runtime: the
probes run during backend selection in every process.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

from radixserve.kernels import KernelQuery

INTERPRET_ENV = "TRITON_INTERPRET"
GPU_DEVICES = ("cuda", "rocm")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRUTHY = {"1", "true", "on", "yes", "y"}


def interpreter_requested() -> bool:
    """True when ``TRITON_INTERPRET`` is set the way Triton itself reads it."""
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in _TRUTHY


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def device_reasons(query: KernelQuery) -> list[str]:
    """Why Triton cannot run on ``query.device`` here (empty: it can)."""
    if not triton_installed():
        return ["triton is not installed (pip install 'radixserve[triton]')"]
    if query.device in GPU_DEVICES:
        return []
    if query.device == "cpu":
        if interpreter_requested():
            return []
        return [
            f"Triton needs a cuda or rocm device; on cpu set {INTERPRET_ENV}=1 "
            "(the Triton interpreter: slow, for testing)"
        ]
    return [f"Triton needs a cuda or rocm device, got {query.device!r}"]


def dtype_reasons(query: KernelQuery) -> list[str]:
    reasons = []
    if query.dtype not in FLOAT_DTYPES:
        reasons.append(f"dtype {query.dtype} is not supported (float32, bfloat16, float16 are)")
    if query.kv_dtype is not None and query.kv_dtype not in FLOAT_DTYPES:
        reasons.append(f"KV cache dtype {query.kv_dtype} is not supported (float32, bfloat16, float16 are)")
    return reasons


def kernel_module(query: KernelQuery, what: str, module: str) -> ModuleType:
    """``radixserve_triton.ops.<module>``, the kernels of the ``what`` backend; a
    RuntimeError on the cpu unless they run in the interpreter."""
    if query.device == "cpu" and not interpreter_requested():
        raise RuntimeError(f"the {what} backend runs on cpu only with {INTERPRET_ENV}=1")
    ops = importlib.import_module("radixserve_triton.ops")
    kernels = importlib.import_module(f"radixserve_triton.ops.{module}")
    if query.device == "cpu" and not ops.INTERPRETED:
        raise RuntimeError(
            f"radixserve_triton's kernels were imported before {INTERPRET_ENV}=1 was set, so they were "
            "built for a GPU; set the variable before the process imports radixserve_triton.ops"
        )
    return kernels
