"""GEMM backends for the CPU plugin: ``torch`` (``F.linear``, any device, the
reference), ``onednn`` (CPU: weights packed once at load time into oneDNN's
blocked layout, so no call reorders them again) and ``cpu_packed`` (bfloat16 and
float32 on AVX-512 CPUs, float32 on AVX2 ones: our own kernels on weights packed at
load time).

``F.linear`` on a bf16 CPU tensor already runs oneDNN, but it reorders the
weight on every call; at decode sizes that reorder costs as much as the
product (see docs/benchmarks.md, P5). In float32 ``F.linear`` runs MKL's sgemm,
and oneDNN on a packed weight is faster at every size measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.kernels import GemmBackend, KernelQuery
from radixserve_torch import cpu_isa, cpu_kernels


class TorchGemm(GemmBackend):
    name = "torch"
    priority = 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)


ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


class OneDnnGemm(GemmBackend):
    """``torch.ops.mkldnn._linear_pointwise`` on weights packed by
    ``torch.ops.mkldnn._reorder_linear_weight``.

    Dense weights (a quantization method's dequantized ones) take the same
    oneDNN product, which gives bit-identical results to the packed weight,
    so a quantized model and its dequantized reference agree exactly.
    """

    name = "onednn"
    priority = 10  # ahead of ``torch`` wherever it applies

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        reasons = []
        if query.device != "cpu":
            reasons.append(f"runs on cpu only, not {query.device!r}")
        if query.dtype not in ONEDNN_DTYPES:
            reasons.append(f"dtype {query.dtype} is not float32 or bfloat16")
        if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]  # unannotated in torch
            reasons.append("this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)")
        elif query.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            # The check honours ONEDNN_MAX_CPU_ISA: under AVX2, oneDNN refuses to pack a bfloat16 weight.
            flags = cpu_isa.cpu_flags() or frozenset()
            cpu_can = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
            cap = cpu_isa.onednn_isa_cap()
            reasons.append(
                f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN from the AVX-512 (or AVX-NE-CONVERT) its bfloat16 needs"
                if cap and cpu_can
                else "this CPU lacks the AVX-512 (or AVX-NE-CONVERT) oneDNN needs for bfloat16"
            )
        return reasons

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        # The batch-size hint only guides oneDNN's choice of layout; a packed
        # weight serves every batch size (hints 1, 32 and 512 showed no consistent difference).
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        return packed

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out


class CpuPackedGemm(GemmBackend):
    """Our own C++ kernels (``csrc/cpu_gemm.cpp``) for AVX-512 CPUs, bfloat16 (with
    AVX512-BF16) and float32, and for AVX2 CPUs (with FMA and F16C), float32, on
    weights packed at load time into strips of 16 output columns. On AVX2 a float32
    weight that bfloat16 or float16 holds exactly (a 16-bit checkpoint served in
    float32) is packed in that type and widened in registers: half the bytes.

    They serve the decode batches of a serving step better than ``onednn``: each
    weight arrives cold from memory once per step, and these kernels stream it
    once at up to twice oneDNN's bandwidth (1-16 rows) and reuse each weight
    vector for six rows (32-128 rows); at prefill sizes they are level with it or
    ahead (docs/benchmarks.md, P5). Weights they do not pack (out features not a
    multiple of 16, odd in features in bfloat16) take ``F.linear``. Dense weights
    handed in per call (a quantization method's dequantized ones) are packed per
    call, so that a quantized model and its dequantized reference agree exactly.
    """

    name = "cpu_packed"
    priority = 20  # ahead of ``onednn`` where it applies

    def __init__(self, query: KernelQuery):
        super().__init__(query)
        cpu_kernels.load()
        self._ops = torch.ops.radixserve_cpu_gemm
        # The overloads themselves: they skip the packet's lookup on every call.
        self._linear = self._ops.linear.default
        self._linear_silu_and_mul = self._ops.linear_silu_and_mul.default
        # Without AVX-512 the float32 kernels are AVX2's, which read a weight packed in
        # bfloat16 or float16 where that holds it exactly: a 16-bit checkpoint served in
        # float32 (what CPUs without bfloat16 dot products serve) then reads half the bytes.
        target = cpu_isa.build_target()
        self._narrows = query.dtype == torch.float32 and target is not None and "avx512f" not in target.features
        built = self._ops.dtypes()
        if str(query.dtype).removeprefix("torch.") not in built:
            raise cpu_kernels.KernelBuildError(
                f"the CPU kernels ({cpu_kernels.loaded_library()}) hold GEMM kernels for {built}, not {query.dtype}"
            )

    @classmethod
    def build(cls) -> None:
        cpu_kernels.load()

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        reasons = []
        if query.device != "cpu":
            reasons.append(f"runs on cpu only, not {query.device!r}")
        needed = _NEEDED_FLAGS.get(query.dtype)
        if needed is None:
            reasons.append(f"dtype {query.dtype} is not float32 or bfloat16")
        else:
            # What the kernels are compiled for, not only what the CPU has: under
            # ATEN_CPU_CAPABILITY=avx2 they are built without AVX-512 (cpu_isa.py).
            target = cpu_isa.build_target()
            if target is not None and not any(flags <= target.features for flags in needed):
                reasons.append(
                    f"its {query.dtype} kernels need {' or '.join(' + '.join(sorted(f)) for f in needed)}, "
                    f"and the CPU kernels are built for {target.origin}, which lacks it"
                )
        return reasons + cpu_kernels.unavailable_reasons()

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return self._pack(weight, self._narrows)

    def _pack(self, weight: torch.Tensor, narrows: bool) -> torch.Tensor:
        """``weight`` packed; stored in 16 bits where ``narrows`` and that is exact (a
        load-time check: weights handed in per call are packed as they are)."""
        out_features, in_features = weight.shape
        group = _GROUP.get(weight.dtype, 0)
        if not group or out_features % 16 or in_features % group:
            return weight
        if narrows:
            narrow = exact_16_bit(weight)
            if narrow is not None:  # [N/16, K, 16, 1], as pack_weight lays out float32
                return narrow.view(out_features // 16, 16, in_features, 1).permute(0, 2, 1, 3).contiguous()
        packed: torch.Tensor = self._ops.pack_weight(weight)
        return packed

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.dim() == 2:
            weight = self._pack(weight, narrows=False)
            if weight.dim() == 2:  # a shape the kernels do not take
                return F.linear(x, weight, bias)
        if x.dim() != 2:
            return self.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], -1)
        # The kernel checks the shapes, strides and dtypes; this is every decode
        # step's most frequent call, so nothing else is done here.
        out = x.new_empty((x.shape[0], weight.shape[0] * 16))
        self._linear(x, weight, None if bias is None else bias.contiguous(), out)
        return out

    def linear_silu_and_mul(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The packed kernel with silu(gate) * up in its epilogue: each register tile
        holds matching gate and up columns, so the projection (twice the width) is
        never written and read back (W2's float32 gate/up and SiLU: 12-20% faster
        in a kernel A/B, docs/benchmarks.md)."""
        if weight.dim() == 2:
            weight = self._pack(weight, narrows=False)
        if weight.dim() != 4 or weight.shape[0] % 2:  # unpacked, or gate and up not whole strips
            return None
        rows = x.reshape(-1, x.shape[-1])
        out = rows.new_empty((rows.shape[0], weight.shape[0] * 8))
        self._linear_silu_and_mul(rows, weight, None if bias is None else bias.contiguous(), out)
        return out.view(*x.shape[:-1], -1)


# Packed layout [N/16, K/G, 16, G]: G in features per 64-byte weight load.
_GROUP = {torch.bfloat16: 2, torch.float32: 1}
# What the kernels of a dtype need the build to have: any one of these sets.
_NEEDED_FLAGS = {
    torch.bfloat16: (frozenset({"avx512_bf16"}),),
    torch.float32: (frozenset({"avx512f"}), frozenset({"avx2", "fma", "f16c"})),
}


def exact_16_bit(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (float32) as bfloat16 or float16 where that type holds every value
    exactly (a 16-bit checkpoint's weights, widened to float32 at load), else None."""
    for dtype in (torch.bfloat16, torch.float16):
        narrow = weight.to(dtype)
        if torch.equal(narrow.to(weight.dtype), weight):
            return narrow
    return None
