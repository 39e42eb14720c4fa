"""Decode attention on the CPU that reads K/V in place from the paged pool.

``torch_varlen`` gathers every request's K/V out of the pool into a workspace
each layer and reads it again in ``bmm``: at W1's decode shape the gather costs
about as much as the attention. Decode attention is memory-bound, and the floor
is reading each K/V row once. This backend does that with a small C++ kernel
(csrc/cpu_paged_attention.cpp): per request it walks ``req_to_token`` and
reads each key's pool rows (K and V of all KV heads of the slot, contiguous)
straight from the pool once, for all query heads, with an online softmax in
float32 (flash-decoding style; long contexts are split across threads when the
batch is too small to occupy them).

Extend (prefill) is delegated to ``torch_varlen``: its bucketed SDPA is
compute-bound matrix work that the kernel, one query row at a time, does not
beat (measurements: docs/plugins.md).

The kernel is compiled on the first construction of the backend in a process,
with ``torch.utils.cpp_extension.load`` (g++ ``-O3 -march=native -fopenmp``),
into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions/<python>_cpu/radixserve_cpu_paged_<capability>``),
so later processes only load it. A build failure raises, with the compiler's
first error line; ``unsupported_reasons`` only checks that a compiler and ninja
are on PATH (and names an earlier build failure in this process), so ``auto``
picks ``torch_varlen`` on a machine without them.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.kernels import AttentionBackend, AttentionLayerSpec, KernelQuery

from radixserve_torch.attention import grouped_heads_reasons
from radixserve_torch.attention_varlen import TorchVarlenAttention

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_paged_attention.cpp"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_kernel: Optional[Callable[..., None]] = None
_build_error: Optional[str] = None


class KernelBuildError(RuntimeError):
    """The C++ kernel failed to compile or load."""


def missing_tools() -> list[str]:
    """What the first build needs and PATH lacks: a C++ compiler ($CXX, else c++,
    as torch's extension builder uses) and ninja. Cheap: nothing is run."""
    missing = []
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        missing.append(f"no C++ compiler found (looked for {os.environ.get('CXX', 'c++')!r} on PATH)")
    if shutil.which("ninja") is None:
        missing.append("ninja not found on PATH (torch's extension builder needs it: pip install ninja)")
    return missing


def extension_name() -> str:
    """One build per instruction set: the kernel is compiled with ``-march=native``."""
    return f"radixserve_cpu_paged_{torch.backends.cpu.get_cpu_capability().lower()}"


def load_kernel() -> Callable[..., None]:
    """``torch.ops.radixserve_cpu_paged.paged_attention``, compiling the kernel the
    first time on this machine (about 10-20 s of CPU) and loading it from the cache
    afterwards; once per process."""
    global _kernel, _build_error
    with _lock:
        if _kernel is not None:
            return _kernel
        if _build_error is not None:
            raise KernelBuildError(_build_error)
        from torch.utils import cpp_extension

        logger.info("loading the cpu_paged attention kernel (compiled on first use on this machine)")
        start = time.perf_counter()
        try:
            library = cpp_extension.load(
                name=extension_name(),
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:  # the compiler's output is in the exception text
            _build_error = f"building the cpu_paged kernel failed: {_first_error_line(str(exc))}"
            raise KernelBuildError(_build_error) from exc
        _kernel = torch.ops.radixserve_cpu_paged.paged_attention
        logger.info("cpu_paged attention kernel ready in %.1f s (%s)", time.perf_counter() - start, library)
        return _kernel


def _first_error_line(text: str) -> str:
    """The compiler's first ``file:line:col: error: ...`` line, else the first line
    mentioning an error, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in (": error:", "error"):
        for line in lines:
            if pattern in line.lower():
                return line
    return lines[-1] if lines else "no compiler output"


@dataclass
class PagedDecodeMetadata:
    """Decode needs no plan beyond the batch's own tensors, made contiguous once per step."""

    rows: torch.Tensor  # [B] int64: each request's row in req_to_token
    lens: torch.Tensor  # [B] int64: its context length


class CpuPagedAttention(AttentionBackend):
    name = "cpu_paged"
    priority = 7  # above torch_varlen (5); below the Triton kernels (10), which do not run on cpu anyway

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        self._kernel = load_kernel()
        self._extend = TorchVarlenAttention(query)

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        reasons = grouped_heads_reasons(query)
        if query.device != "cpu":
            reasons.append(f"a CPU kernel; device is {query.device}")
        if query.dtype not in _DTYPES:
            reasons.append(f"dtype {query.dtype} is not float32, bfloat16 or float16")
        if query.kv_dtype is not None and query.kv_dtype != query.dtype:
            reasons.append(f"the KV pool dtype {query.kv_dtype} must equal the compute dtype {query.dtype}")
        reasons += missing_tools()
        if _build_error is not None:
            reasons.append(_build_error)
        return reasons

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            batch.attn_metadata = PagedDecodeMetadata(batch.req_pool_indices.contiguous(), batch.seq_lens.contiguous())
        else:
            self._extend.init_forward_metadata(batch)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta: PagedDecodeMetadata = batch.attn_metadata
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._kernel(q, k_buf, v_buf, batch.req_to_token, meta.rows, meta.lens, layer.scaling, out)
        return out

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        return self._extend.forward_extend(q, layer, batch)
