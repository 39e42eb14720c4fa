"""``cpu_fused``: RMSNorm (with the residual add fused in), SiLU-and-mul and rotary
in one C++ pass over memory each (csrc/cpu_elementwise.cpp), the CPU default;
and the sampler's grammar mask, written over the forbidden tokens in place.

``torch_native`` spends five to seven torch calls on a norm and two on
SiLU-and-mul, each reading and writing the whole activation (a ``[2048, 5632]``
gate/up output is 23 MB in bfloat16): about a tenth of a prefill step and of a
decode step on the benchmark models. These ops round where the reference rounds
(the residual sum, the normalised value and silu(gate) in the model dtype), so
they agree with it to the last bit of float32, or rarely one unit of the model
dtype (their sum of squares and exp differ from torch's in rounding). Rotary in
the reference is ten torch calls per layer (the cos/sin lookup, concatenations,
products and sums), a few percent of a decode step of a deep narrow model; here it
is one, exact in every dtype but float32, where the compiler may fuse a product
into the sum. The layouts the C++ ops do not take (per-head norms on views with
more than two strided dimensions, other position dtypes) run the reference's
torch code.

The grammar mask in the reference unpacks the bitmask into a ``[rows, V]`` bool
tensor and runs torch's ``masked_fill``: 17-18 ms at 32 rows of a 152k
vocabulary on the 2-core EPYC. The kernel skips the words of all ones and
blends the others into their 32 logits as raw bits (docs/benchmarks.md, P12).
"""

from __future__ import annotations

import torch

from radixserve.kernels import KernelQuery
from radixserve.kernels.elementwise import NormResult
from radixserve_torch import cpu_kernels
from radixserve_torch.elementwise import TorchNativeElementwise

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuFusedElementwise(TorchNativeElementwise):
    name = "cpu_fused"
    priority = 5  # above torch_native (0); the Triton backends (10) do not run on cpu

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        cpu_kernels.load()
        self._ops = torch.ops.radixserve_cpu_elementwise

    @classmethod
    def build(cls) -> None:
        cpu_kernels.load()

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        # the model-specific ops are the reference's torch code, inherited
        return cpu_kernels.query_reasons(query) + super().unsupported_reasons(query) + cpu_kernels.unavailable_reasons()

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> NormResult:
        if residual is not None:
            if x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
                self._ops.add_rms_norm(x, residual, weight, eps)
                return x, residual
            return super().rms_norm(x, weight, eps, residual)
        rows = _as_3d(x)
        if rows is None:
            return super().rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._ops.rms_norm(rows, weight, eps, out)
        return out

    def apply_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        neox_style: bool = True,
    ) -> None:
        if (
            q.dim() == k.dim() == 3
            and q.stride(-1) == k.stride(-1) == 1
            and positions.dtype == torch.int64
            and cos_sin_cache.dtype == q.dtype == k.dtype
            and cos_sin_cache.is_contiguous()
        ):
            self._ops.rotary(q, k, positions.contiguous(), cos_sin_cache, neox_style)
        else:
            super().apply_rotary(q, k, positions, cos_sin_cache, neox_style)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else None
        if rows is None or rows.stride(-1) != 1:
            return super().silu_and_mul(x)
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
        self._ops.silu_and_mul(rows, out.view(-1, out.shape[-1]))
        return out

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        if (
            logits.dim() == 2
            and logits.stride(-1) == 1
            and logits.dtype in _DTYPES
            and bitmask.dtype == torch.int32
            and bitmask.is_contiguous()
            and rows.dtype == torch.int64
        ):
            self._ops.apply_token_bitmask(logits, bitmask, rows.contiguous())
        else:
            super().apply_token_bitmask(logits, bitmask, rows)


def _as_3d(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as an ``[A, B, H]`` view with its own strides (last one 1), when it has one."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    try:
        return x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:
        return None
