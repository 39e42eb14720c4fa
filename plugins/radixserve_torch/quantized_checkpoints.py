"""Checkpoints that ship quantized: GPTQ (4 and 8 bit), AWQ (4 bit, GEMM packing),
compressed-tensors ``pack-quantized`` (4 and 8 bit), GGUF's block and k-quant
projections (checkpoints/gguf.py reads them), all weight-only with activations in the model dtype
(W4A16, W8A16); and FP8 with block scales (``FP8Blocks``, dequantized at load).

Loading turns each checkpoint tensor into the same out-major form whatever the format,
so that the linear layers' own loaders (tensor-parallel slices, fused q/k/v and
gate/up shards) apply unchanged: ``qweight`` ``[out, in]`` of unsigned integers
(one a byte), ``scales`` ``[out, groups]`` and ``qzeros`` ``[out, groups]``; a weight
is ``(qweight - qzeros) * scales`` over its group of ``group_size`` inputs.

After loading, 4-bit weights of a bfloat16 model on the CPU go to an int4 kernel,
which reads a quarter of the bytes of bfloat16 weights (what batch-1 decode, bound by
memory, is paced by): radixserve's own (csrc/cpu_int4.cpp, AVX512-BF16) or ATen's
(``torch._weight_int4pack_mm_for_cpu``, groups of 32 to 256), whichever is faster at
batch 1 on the layer's shape, timed once per shape at load; 5- to 8-bit weights to
the same kernel's byte path. A float32 model (a CPU without bfloat16 dot products)
takes the kernel's float32 path (AVX2, FMA, F16C) the same way. Where no kernel beats
the GEMM backend on the dequantized weight (ATen's kernel on a CPU without AVX-512),
or none applies, the weight is dequantized once at load and computed as a dense one.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, cast

import torch
from torch import nn

from radixserve.kernels import GemmBackend, KernelQuery, QuantizationMethod, QuantizedCheckpoint
from radixserve.kernels.quantization import WeightLoader
from radixserve.layers.weights import CheckpointTensor
from radixserve_torch import cpu_isa, cpu_kernels

logger = logging.getLogger(__name__)

# AWQ's GEMM packing puts output column 8c + ORDER[i] in nibble i of word c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)


def _register(layer: nn.Module, name: str, empty: torch.Tensor, loader: WeightLoader) -> None:
    """A parameter of ``layer`` that the model loader fills through ``loader``."""
    param = nn.Parameter(empty, requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]  # an ad hoc attribute torch's stubs lack
    layer.register_parameter(name, param)


def _tensor(loaded: torch.Tensor | CheckpointTensor) -> torch.Tensor:
    return loaded.load() if isinstance(loaded, CheckpointTensor) else loaded


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[rows, cols]`` int32 words, each holding ``32 // bits`` values of consecutive
    rows (lowest bits first) -> ``[rows * 32 // bits, cols]`` uint8."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0] * per, packed.shape[1]).to(torch.uint8)


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[rows, cols]`` int32 words, each holding ``32 // bits`` values of consecutive
    columns (lowest bits first; with ``order``, value ``i`` is column ``order[i]`` of the
    word's) -> ``[rows, cols * 32 // bits]`` uint8."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed[:, :, None] >> shifts) & ((1 << bits) - 1)  # [rows, cols, per]: value i of each word
    if order is not None:
        values = values[:, :, [order.index(column) for column in range(len(order))]]
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


class ShippedQuantization(QuantizationMethod):
    """A method that loads checkpoints shipped quantized: selected only for a query whose
    ``quantized_checkpoint`` names it (config.json's ``quantization_config``)."""

    priority = 0
    loads: ClassVar[str] = "checkpoints"  # what it loads, for the refusal

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        scheme = query.quantized_checkpoint
        if scheme is None or scheme.method != cls.name:
            return [f"loads {cls.loads} only (config.json's quantization_config names the method {cls.name})"]
        return []

    @property
    def scheme(self) -> QuantizedCheckpoint:
        scheme = self.query.quantized_checkpoint
        assert scheme is not None  # unsupported_reasons refuses a query without one
        return scheme


class DequantizedAtLoad(ShippedQuantization):
    """A method whose weights are dequantized once at load (``dense_weight`` of the
    loaded tensors) and computed by the GEMM backend as dense ones."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        names = self.checkpoint_tensor_names()
        tensors = {name: cast(torch.Tensor, getattr(layer, name)).data for name in names}
        for name in names:
            delattr(layer, name)
        dense = self.dense_weight(tensors).to(self.query.dtype)
        layer.register_buffer("weight", self.gemm.prepare_weight(dense))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemm.linear(x, cast(torch.Tensor, layer.weight), bias)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return self.gemm.linear_silu_and_mul(x, cast(torch.Tensor, layer.weight), bias)


class QuantizedCheckpointMethod(ShippedQuantization):
    """A weight-only method for integer checkpoints (``name``: the method
    ``checkpoints.quantized`` names for config.json's ``quantization_config``)."""

    # The checkpoint's names of the packed integers, the zero points and the scales.
    tensor_names: ClassVar[tuple[str, str, str]] = ("qweight", "qzeros", "scales")
    # The format's other tensors of a linear weight (``register_extra`` registers them).
    extra_tensor_names: ClassVar[tuple[str, ...]] = ()
    zero_point_dtype: ClassVar[torch.dtype] = torch.uint8

    def __init__(self, query: KernelQuery, gemm: GemmBackend):
        super().__init__(query, gemm)
        # The int4 kernel each shape (out, in, group) runs, None: dequantized; timed once.
        self._int4_choice: dict[tuple[int, int, int], type[Int4Kernel] | None] = {}

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        group = self.scheme.group_size if self.scheme.group_size != -1 else in_features
        if in_features % group:
            raise ValueError(
                f"quantization_config.group_size: {group} does not divide a layer's {in_features} input features "
                "(under tensor parallelism: its share of them)"
            )
        integers, zeros, scales = self.tensor_names
        # One group a row (by channel): its zero points and scales one-dimensional, which
        # the layers replicate where tensor parallelism splits the inputs (the group spans them).
        per_row: tuple[int, ...] = (
            (out_features,) if self.scheme.group_size == -1 else (out_features, in_features // group)
        )
        shapes = {
            integers: ((out_features, in_features), torch.uint8),
            zeros: (per_row, self.zero_point_dtype),
            scales: (per_row, torch.float32),
        }
        if not self.zero_points_stored():
            del shapes[zeros]
        for name, (shape, dtype) in shapes.items():
            _register(layer, name, torch.empty(shape, dtype=dtype), self._converting(name, weight_loader))
        self.register_extra(layer, in_features)

    def register_extra(self, layer: nn.Module, in_features: int) -> None:
        """The format's other checkpoint tensors, each with a loader of its own (none here)."""

    def _converting(self, name: str, weight_loader: WeightLoader) -> WeightLoader:
        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            tensor = self.out_major(name, _tensor(loaded))
            weight_loader(param, tensor.reshape(-1) if param.dim() == 1 else tensor, shard_id)

        return load

    def out_major(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as the out-major parameter ``name`` holds it."""
        raise NotImplementedError

    def zero_points_stored(self) -> bool:
        """Whether the checkpoint stores zero points (else each is the middle of the range)."""
        return True

    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        integers, zeros, scales = self.tensor_names
        stored = (integers, zeros, scales) if self.zero_points_stored() else (integers, scales)
        return stored + self.extra_tensor_names

    def dense_weight(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        integers, zero_points, scale_name = self.tensor_names
        qweight = self.out_major(integers, tensors[integers])
        scales = self.out_major(scale_name, tensors[scale_name]).float()
        if self.zero_points_stored():
            zeros = self.out_major(zero_points, tensors[zero_points]).float()
        else:
            zeros = torch.full(scales.shape, float(1 << (self.scheme.bits - 1)))
        groups = self.input_groups(tensors, qweight.shape[1], scales.shape[1])
        return (qweight.float() - zeros[:, groups]) * scales[:, groups]

    def input_groups(self, tensors: Mapping[str, torch.Tensor], inputs: int, groups: int) -> torch.Tensor:
        """Each input's group, for ``dense_weight``: in order, ``inputs / groups`` a group."""
        return torch.arange(inputs) // (inputs // groups)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        integers, zero_points, scale_name = self.tensor_names
        qweight = cast(torch.Tensor, getattr(layer, integers)).data
        scales = cast(torch.Tensor, getattr(layer, scale_name)).data.reshape(qweight.shape[0], -1)
        if self.zero_points_stored():
            zeros = cast(torch.Tensor, getattr(layer, zero_points)).data.reshape(qweight.shape[0], -1)
            delattr(layer, zero_points)
        else:
            zeros = torch.full(scales.shape, 1 << (self.scheme.bits - 1), dtype=torch.uint8, device=scales.device)
        zeros, scales = self.regroup(zeros, scales)
        group = qweight.shape[1] // scales.shape[1]
        delattr(layer, integers)
        delattr(layer, scale_name)
        order = self.input_order(layer, group)
        if order is not None:  # the inputs reordered so that each group's are contiguous
            qweight = qweight[:, order]
            layer.register_buffer("input_order", order)
        kernels = self.int4_kernels(qweight.shape, group, self.layer_bits(qweight))
        if kernels:
            chosen = self._fastest(kernels, qweight, zeros, scales, group)
            if chosen is not None:
                layer.int4 = chosen.pack(qweight, zeros, scales, group)  # type: ignore[assignment]  # CPU-only
                return
        # Elsewhere the weight is dequantized once, here, and the GEMM backend computes
        # with it as with any dense weight: as fast as the model dtype, not as small.
        dense = dequantize(qweight, zeros, scales).to(self.query.dtype)
        layer.register_buffer("weight", self.gemm.prepare_weight(dense))

    def regroup(self, zeros: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's zero points and scales in the groups its kernel reads (as loaded here)."""
        return zeros, scales

    def layer_bits(self, qweight: torch.Tensor) -> int:
        """The bits a layer's integers take (the checkpoint's, here)."""
        return self.scheme.bits

    def int4_kernels(self, shape: torch.Size, group: int, bits: int) -> list[type[Int4Kernel]]:
        """The int4 kernels that can compute a layer of ``shape`` ([out, in]) here: 4-bit
        weights of a bfloat16 or float32 model on the CPU, and what each kernel needs
        besides; 5 to 8 bits through ours, one integer a byte (``ByteStrips``;
        ``SevenBitStrips`` below 8 bits; in float32 ``FloatByteStrips`` for all)."""
        query = self.query
        if not 4 <= bits <= 8 or query.device != "cpu":
            return []
        kernels: tuple[type[Int4Kernel], ...]
        if query.dtype == torch.float32:
            kernels = (FloatNibbleStrips,) if bits == 4 else (FloatByteStrips,)
        elif query.dtype == torch.bfloat16:
            kernels = (NibbleStrips, AtenInt4)
            if bits > 4:
                kernels = (ByteStrips,) if bits == 8 else (SevenBitStrips, ByteStrips)
        else:
            return []
        return [kernel for kernel in kernels if kernel.serves(shape, group)]

    def _fastest(
        self,
        kernels: list[type[Int4Kernel]],
        qweight: torch.Tensor,
        zeros: torch.Tensor,
        scales: torch.Tensor,
        group: int,
    ) -> type[Int4Kernel] | None:
        """The kernel of ``kernels`` that serves this layer's shape best (``choose_by_time``),
        or None where the GEMM backend on the dequantized weight does; timed once per
        shape. ATen's kernel is 4x faster than bfloat16 with AVX-512 at batch 1 but slows
        with every row, about even with AVX2, and without either (its scalar path) many
        times slower: there the weights are dequantized."""
        shape = (qweight.shape[0], qweight.shape[1], group)
        if shape not in self._int4_choice:
            dense = self.gemm.prepare_weight(dequantize(qweight, zeros, scales).to(self.query.dtype))
            candidates: dict[str, Callable[[torch.Tensor], object]] = {
                f"dequantized ({self.gemm.name})": lambda x: self.gemm.linear(x, dense)
            }
            for kernel in kernels:
                candidates[kernel.name] = kernel.pack(qweight, zeros, scales, group).matmul
            best = choose_by_time(
                f"{self.name}: a {shape[0]} x {shape[1]} layer", candidates, shape[1], self.query.dtype
            )
            self._int4_choice[shape] = next((k for k in kernels if k.name == best), None)
        return self._int4_choice[shape]

    def input_order(self, layer: nn.Module, group: int) -> torch.Tensor | None:
        """The order of the inputs that puts each group's together (None: they are)."""
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if hasattr(layer, "input_order"):
            x = x.index_select(-1, cast(torch.Tensor, layer.input_order))
        int4 = cast("Int4Kernel | None", getattr(layer, "int4", None))
        if int4 is None:
            return self.gemm.linear(x, cast(torch.Tensor, layer.weight), bias)
        out = int4.matmul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if hasattr(layer, "int4") or hasattr(layer, "input_order"):
            return None
        return self.gemm.linear_silu_and_mul(x, cast(torch.Tensor, layer.weight), bias)


_SCRATCH: list[torch.Tensor] = []  # 64 MiB written between timed calls: larger than a CPU's caches
TIMED_ROWS = (1, 16)  # a lone stream's decode step, and a batch's


BATCH_SLOWDOWN_LIMIT = 1.5  # how much slower than the best at 16 rows a choice may be


def choose_by_time(
    what: str, candidates: dict[str, Callable[[torch.Tensor], object]], in_features: int, dtype: torch.dtype
) -> str:
    """The candidate (ways of computing one layer) fastest at one row of input -- a lone
    stream's decode step, memory-bound, which is what a quantized weight is for -- among
    those within ``BATCH_SLOWDOWN_LIMIT`` of the fastest at sixteen (so that batches and
    prefill do not pay for it: ATen's int4 kernel, ahead at one row, is twice as slow at
    sixteen). Each is timed cold (``_best_time``); logged with every time."""
    times = {
        name: [_best_time(run, torch.randn(rows, in_features, dtype=dtype)) for rows in TIMED_ROWS]
        for name, run in candidates.items()
    }
    batched = min(row_times[1] for row_times in times.values())
    allowed = [name for name, row_times in times.items() if row_times[1] <= BATCH_SLOWDOWN_LIMIT * batched]
    best = min(allowed, key=lambda name: times[name][0])
    logger.info(
        "%s at %s rows: %s; using %s",
        what,
        " / ".join(map(str, TIMED_ROWS)),
        ", ".join(f"{name} {' / '.join(f'{t * 1e3:.3f}' for t in row_times)} ms" for name, row_times in times.items()),
        best,
    )
    return best


def _best_time(run: Callable[..., object], *args: object, repeats: int = 5) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``run(*args)``, after one to warm up,
    each with the caches refilled by other data first: a decode step reads each weight
    once, cold from memory, and a kernel timed on a weight still in cache can look
    faster than one that streams memory better."""
    if not _SCRATCH:
        _SCRATCH.append(torch.zeros(16 << 20))
    run(*args)
    best = float("inf")
    for _ in range(repeats):
        _SCRATCH[0].add_(1.0)
        start = time.perf_counter()
        run(*args)
        best = min(best, time.perf_counter() - start)
    return best


class Int4Kernel(ABC):
    """A weight repacked for an int4 kernel, which computes ``x @ W.T`` for a bfloat16
    ``x`` ``[rows, in]``, ``W = (q - 8) * scale + offset`` per group of inputs (the offset
    is ``(8 - zero) * scale``)."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def serves(cls, shape: torch.Size, group: int) -> bool: ...

    @classmethod
    @abstractmethod
    def pack(cls, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> Int4Kernel: ...

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...


class AtenInt4(Int4Kernel):
    """ATen's int4 CPU kernel (``torch._weight_int4pack_mm_for_cpu``), groups of 32 to 256."""

    name = "aten int4"

    def __init__(self, packed: torch.Tensor, scales_and_offsets: torch.Tensor, group: int):
        self.packed, self.scales_and_offsets, self.group = packed, scales_and_offsets, group

    @classmethod
    def serves(cls, shape: torch.Size, group: int) -> bool:
        return group in INT4PACK_GROUP_SIZES

    @classmethod
    def pack(cls, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> AtenInt4:
        offsets = (8 - zeros.float()) * scales
        scales_and_offsets = torch.stack([scales.t(), offsets.t()], dim=-1).to(torch.bfloat16).contiguous()
        return cls(torch._convert_weight_to_int4pack_for_cpu(qweight.to(torch.int32), 2), scales_and_offsets, group)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_offsets)


# What csrc/cpu_int4.cpp's kernels of an activation dtype need the build target to have.
_INT4_NEEDED_FLAGS = {torch.bfloat16: frozenset({"avx512_bf16"}), torch.float32: frozenset({"avx2", "fma", "f16c"})}


class NibbleStrips(Int4Kernel):
    """radixserve's own int4 kernel (csrc/cpu_int4.cpp, AVX512-BF16), which streams the
    nibbles in strips of 16 output columns: ``packed`` ``[out/16, in/8, 64]`` uint8,
    scales and offsets ``[out/16, in/group, 16]`` float16 (the layout is the kernel's)."""

    name = "radixserve int4"
    bits: ClassVar[int] = 4
    inputs_a_chunk: ClassVar[int] = 8  # inputs of one strip's 64-byte chunk
    dtype: ClassVar[torch.dtype] = torch.bfloat16  # of the activations (and the layout)

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int, shift: int):
        self.packed, self.scales, self.offsets, self.group = packed, scales, offsets, group
        self.shift = shift  # the scales and offsets are stored times 2 ** shift (the kernel divides out back)

    @classmethod
    def serves(cls, shape: torch.Size, group: int) -> bool:
        if shape[0] % 16 or group % cls.inputs_a_chunk:
            return False
        # What the build target lacks, no build has: the library is not compiled to learn it.
        target = cpu_isa.build_target()
        if target is None or not _INT4_NEEDED_FLAGS[cls.dtype] <= target.features:
            return False
        try:
            cpu_kernels.load()
        except cpu_kernels.KernelBuildError:
            return False  # the other paths serve: which one is logged at the choice
        return bool(torch.ops.radixserve_cpu_int4.available(cls.dtype))

    @classmethod
    def pack(cls, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> NibbleStrips:
        scales = scales.float()
        # W = (q - 8) * scale + offset: the kernel takes the 8 (and the 128 of its bfloat16 weights) off itself
        return cls._with_figures(cls.packed_weight(qweight), scales, (8 - zeros.float()) * scales, group)

    @classmethod
    def packed_weight(cls, qweight: torch.Tensor) -> torch.Tensor:
        out, inputs = qweight.shape
        # (strip, column, chunk, i, j) -> (strip, chunk, lane = 2 column + j, nibble i)
        q = qweight.view(out // 16, 16, inputs // 8, 4, 2).permute(0, 2, 1, 4, 3).to(torch.int32)
        lanes = (q[..., 0] | q[..., 1] << 4 | q[..., 2] << 8 | q[..., 3] << 12).reshape(out // 16, inputs // 8, 32)
        return lanes.to(torch.int16).view(torch.uint8).contiguous()  # little-endian 16-bit lanes

    @classmethod
    def _with_figures(
        cls, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int
    ) -> NibbleStrips:
        """The kernel on ``packed`` with ``scales`` and ``offsets`` ``[out, groups]`` float32,
        stored by strip in float16 after a power of two that brings them into float16's
        range (float16 keeps 11 bits from 6.1e-5 to 65504; the kernel divides its sums back
        before rounding them). For float32 activations, float16 only where that is exact
        (else float32: a float32 model computes with the checkpoint's weights), and no
        offsets where all are zero (symmetric formats: bytes a step need not read)."""
        strips = packed.shape[0]

        def by_strip(values: torch.Tensor) -> torch.Tensor:
            shifted = values.float() * 2.0**shift
            if cls.dtype == torch.float32 and not torch.equal(shifted.half().float(), shifted):
                stored = shifted
            else:
                stored = shifted.half()
            return stored.view(strips, 16, -1).transpose(1, 2).contiguous()

        largest = float(torch.maximum(scales.abs().max(), offsets.abs().max()))
        shift = int(math.floor(math.log2(16384 / largest))) if largest > 0 else 0
        if cls.dtype == torch.float32 and not offsets.any():
            return cls(packed, by_strip(scales), torch.empty(0), group, shift)
        return cls(packed, by_strip(scales), by_strip(offsets), group, shift)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.packed.shape[0] * 16, dtype=self.dtype)
        torch.ops.radixserve_cpu_int4.linear(
            x.contiguous(), self.packed, self.scales, self.offsets, self.group, self.bits, 2.0**-self.shift, out
        )
        return out


class ByteStrips(NibbleStrips):
    """The same kernel on 5- to 8-bit integers, one a byte (GPTQ-Int8, W8A16, GGUF's
    Q5/Q6_K/Q8_0): ``packed`` ``[out/16, in/4, 64]``, each 32 bytes one operand of 16
    columns x 2 inputs, converted to bfloat16 exactly in registers."""

    name = "radixserve int8"
    bits = 8
    inputs_a_chunk = 4

    @classmethod
    def pack(cls, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> NibbleStrips:
        scales = scales.float()
        return cls._with_figures(cls.packed_weight(qweight), scales, -zeros.float() * scales, group)

    @classmethod
    def packed_weight(cls, qweight: torch.Tensor) -> torch.Tensor:
        out, inputs = qweight.shape
        # (strip, column, chunk, i, j) -> (strip, chunk, operand i, column, j)
        q = qweight.view(out // 16, 16, inputs // 4, 2, 2).permute(0, 2, 3, 1, 4)
        return q.reshape(out // 16, inputs // 4, 64).contiguous()


class SevenBitStrips(ByteStrips):
    """``ByteStrips`` for integers below 128 (GGUF's Q5 and Q6_K, 5- to 7-bit GPTQ):
    decoded as the 4-bit weights are, into the bfloat16 128 + q (the kernel takes the
    128 off), in three instructions for 32 weights rather than seven."""

    name = "radixserve int7"
    bits = 7


class FloatNibbleStrips(NibbleStrips):
    """The kernel's float32 path (AVX2, FMA and F16C: CPUs without bfloat16 dot
    products, where models are served in float32), 4 bits: ``packed`` ``[out/16, in/8,
    64]``, each chunk 16 little-endian 32-bit lanes, lane ``c`` the nibbles of column
    ``c`` for the chunk's 8 inputs in order (nibble ``i``: input ``8t + i``), which the
    kernel turns into floats with a shift, a mask and an OR."""

    name = "radixserve int4 (float32)"
    dtype = torch.float32

    @classmethod
    def packed_weight(cls, qweight: torch.Tensor) -> torch.Tensor:
        out, inputs = qweight.shape
        # (strip, column, chunk, i) -> (strip, chunk, lane = column, nibble i)
        q = qweight.view(out // 16, 16, inputs // 8, 8).permute(0, 2, 1, 3).to(torch.int64)
        lanes = (q << (4 * torch.arange(8))).sum(-1)  # the nibbles of a lane are disjoint bits
        return lanes.to(torch.uint32).view(torch.uint8).reshape(out // 16, inputs // 8, 64).contiguous()


class FloatByteStrips(ByteStrips):
    """The float32 path on 5- to 8-bit integers: ``packed`` ``[out/16, in/4, 64]``, byte
    ``16j + c`` of a chunk the weight of column ``c`` and input ``4t + j``, widened and
    converted to float32 in registers, 8 columns at a time."""

    name = "radixserve int8 (float32)"
    dtype = torch.float32

    @classmethod
    def packed_weight(cls, qweight: torch.Tensor) -> torch.Tensor:
        out, inputs = qweight.shape
        # (strip, column, chunk, j) -> (strip, chunk, j, column)
        q = qweight.view(out // 16, 16, inputs // 4, 4).permute(0, 2, 3, 1)
        return q.reshape(out // 16, inputs // 4, 64).contiguous()


def dequantize(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(qweight - zeros) * scales`` in float32, each group's zero point and scale over
    its ``in // groups`` inputs: ``[out, in]``."""
    out, groups = scales.shape
    grouped = qweight.view(out, groups, -1).float() - zeros.float()[..., None]
    return (grouped * scales[..., None]).view(out, -1)


class GPTQ(QuantizedCheckpointMethod):
    """GPTQ: ``qweight`` ``[in / (32 / bits), out]`` (words along the input), ``qzeros``
    ``[groups, out / (32 / bits)]`` (words along the output; less one in GPTQ's own
    format), ``scales`` ``[groups, out]``, ``g_idx`` ``[in]``: each input's group,
    ``index // group_size`` unless ``desc_act`` (act-order: groups were formed in the
    order of the inputs' importance). Act-order inputs are reordered once at load so
    that each group's are contiguous, and each forward reorders its activations alike
    (one gather); every projection of a fused layer shares its input, so shares that
    order (GPTQ derives it from the input)."""

    name = "gptq"
    extra_tensor_names = ("g_idx",)

    def input_groups(self, tensors: Mapping[str, torch.Tensor], inputs: int, groups: int) -> torch.Tensor:
        return tensors["g_idx"].long() if self.scheme.desc_act else super().input_groups(tensors, inputs, groups)

    def register_extra(self, layer: nn.Module, in_features: int) -> None:
        _register(layer, "g_idx", torch.empty(in_features, dtype=torch.int32), self._load_g_idx)

    def _load_g_idx(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        g_idx = _tensor(loaded).to(torch.int32)  # the whole layer's inputs, whatever this rank holds
        group = self.scheme.group_size if self.scheme.group_size != -1 else len(g_idx)
        if not self.scheme.desc_act:  # each input's group is its index // group_size: checked, not kept
            if not torch.equal(g_idx, torch.arange(len(g_idx), dtype=torch.int32) // group):
                raise ValueError(
                    "g_idx: the inputs' groups are not in order (an act-order checkpoint) though "
                    "quantization_config.desc_act is false"
                )
            return
        if len(g_idx) != len(param):
            raise ValueError(
                f"g_idx: {len(g_idx)} inputs where this rank's layer has {len(param)}: act-order "
                "(quantization_config.desc_act) with tensor parallelism splitting a layer's inputs is not served"
            )
        if getattr(param, "loaded_once", False) and not torch.equal(param.data, g_idx):
            raise ValueError(f"g_idx: shard {shard_id!r} orders the shared input differently from the others")
        param.data.copy_(g_idx)
        param.loaded_once = True  # type: ignore[attr-defined]

    def input_order(self, layer: nn.Module, group: int) -> torch.Tensor | None:
        g_idx = cast(torch.Tensor, layer.g_idx).data
        del layer.g_idx
        if not self.scheme.desc_act:
            return None
        order = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[order], torch.arange(len(g_idx), dtype=g_idx.dtype) // group):
            raise ValueError(f"g_idx: its groups are not of {group} inputs each")
        return order

    def out_major(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        bits = self.scheme.bits
        if name == "qweight":
            return unpack_rows(loaded, bits).t()
        if name == "qzeros":
            return (unpack_columns(loaded, bits) + self.scheme.zero_offset).t()
        return loaded.t()


class AWQ(QuantizedCheckpointMethod):
    """AWQ (GEMM packing): ``qweight`` ``[in, out / 8]`` and ``qzeros`` ``[groups, out / 8]``
    (words along the output, in AWQ's interleaved order), ``scales`` ``[groups, out]``."""

    name = "awq"

    def out_major(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        if name in ("qweight", "qzeros"):
            return unpack_columns(loaded, self.scheme.bits, AWQ_ORDER).t()
        return loaded.t()


class CompressedTensors(QuantizedCheckpointMethod):
    """llm-compressor's compressed-tensors ``pack-quantized`` (W4A16, W8A16):
    ``weight_packed`` ``[out, in / (32 / bits)]`` (words along the input), each value
    stored plus ``2 ** (bits - 1)``; ``weight_scale`` ``[out, groups]``;
    ``weight_zero_point`` ``[out / (32 / bits), groups]`` (words along the output, stored
    plus the same) only when asymmetric; ``weight_shape``, the dense shape (checked)."""

    name = "compressed-tensors"
    tensor_names = ("weight_packed", "weight_zero_point", "weight_scale")
    extra_tensor_names = ("weight_shape",)

    def zero_points_stored(self) -> bool:
        return not self.scheme.symmetric

    def register_extra(self, layer: nn.Module, in_features: int) -> None:
        _register(layer, "weight_shape", torch.empty(2, dtype=torch.int64), self._check_shape)

    def _check_shape(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """The dense shape of the whole checkpoint tensor: two positive sizes (this rank's
        share of them is the layer's)."""
        shape = _tensor(loaded)
        if shape.numel() != 2 or bool((shape <= 0).any()):
            raise ValueError(f"weight_shape: {shape.tolist()} is not a matrix's shape")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        del layer.weight_shape
        super().process_weights_after_loading(layer)

    def out_major(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        bits = self.scheme.bits
        if name == "weight_packed":
            return unpack_columns(loaded, bits)
        if name == "weight_zero_point":
            return unpack_rows(loaded, bits)
        return loaded


class GGUFBlocks(QuantizedCheckpointMethod):
    """A GGUF file's projections, which checkpoints/gguf.py reads already out-major:
    ``qweight`` (unsigned), float ``qzeros`` (fractional for the types with a minimum)
    and ``scales``, all at the file's common group size. A layer whose groups pair up
    (a 32-input type read at 16 because the file also holds Q6_K) is read back at the
    coarser size, and a layer whose integers all fit in 4 bits (Q4_0, Q4_1, Q4_K, or a
    fused layer of those) goes to the int4 kernels."""

    name = "gguf"
    zero_point_dtype = torch.float32

    def out_major(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        return loaded

    def regroup(self, zeros: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while scales.shape[1] % 2 == 0 and all(torch.equal(t[:, 0::2], t[:, 1::2]) for t in (zeros, scales)):
            zeros, scales = zeros[:, 0::2].contiguous(), scales[:, 0::2].contiguous()
        return zeros, scales

    def layer_bits(self, qweight: torch.Tensor) -> int:
        return 4 if int(qweight.max()) < 16 else self.scheme.bits


class FP8Blocks(DequantizedAtLoad):
    """FP8 checkpoints with block scales (config.json's ``quant_method: fp8`` with a
    ``weight_block_size``, as DeepSeek-V3 and Qwen3 ship them): ``weight`` float8 e4m3
    ``[out, in]`` and ``weight_scale_inv`` ``[out / B, in / B]`` (rounded up), the scale
    of each B x B block, which multiplies it. A CPU has no FP8 arithmetic: the weight is
    dequantized once at load and computed as a dense one (as fast as the model dtype,
    not smaller). The scales are kept row by row while loading (``[out, in / B]``) so
    that the layers' own loaders slice them as they slice the weight."""

    name = "fp8_block"
    loads = "FP8 checkpoints with block scales"

    @property
    def block(self) -> int:
        return self.scheme.group_size

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        _register(layer, "weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), weight_loader)
        blocks = -(-in_features // self.block)
        scales = torch.empty(out_features, blocks, dtype=torch.float32)
        _register(layer, "weight_scale_inv", scales, self._by_row(weight_loader))

    def _by_row(self, weight_loader: WeightLoader) -> WeightLoader:
        """The checkpoint's scales, one row per block of outputs, repeated for each output."""

        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            scales = _tensor(loaded).float()
            weight_loader(param, scales.repeat_interleave(self.block, dim=0), shard_id)

        return load

    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        return ("weight", "weight_scale_inv")

    def dense_weight(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The scales as the checkpoint has them (a row per block of outputs) or as
        loaded into a layer (a row per output)."""
        weight, scales = tensors["weight"], tensors["weight_scale_inv"].float()
        if scales.shape[0] != weight.shape[0]:
            scales = scales.repeat_interleave(self.block, dim=0)
        blocks = scales.repeat_interleave(self.block, dim=1)
        return weight.float() * blocks[: weight.shape[0], : weight.shape[1]]


class CompressedTensorsW8A8(DequantizedAtLoad):
    """compressed-tensors' ``int-quantized`` and ``float-quantized`` checkpoints (W8A8
    int8, FP8 and FP8-dynamic as llm-compressor's presets make them; W8A16 where
    activations are left alone): ``weight`` int8 or float8 e4m3 ``[out, in]``,
    ``weight_scale`` ``[out, 1]`` (by channel) or ``[1]`` (by tensor: spread over the
    tensor's rows at load, so that fused layers keep each projection's own), and, for
    static activations, ``input_scale`` ``[1]`` (a fused layer's projections share
    their input: the largest of their scales is used).

    The weights are dequantized at load and computed by the GEMM backend; the
    activations are rounded as compressed-tensors rounds them (symmetric, the scale the
    largest magnitude of the token, or the stored scale, over 127.5 for int8 or 448 for
    float8; to nearest, clamped) before each product: the checkpoint's arithmetic but
    for the order of the sums, at the model dtype's speed. Int8 products
    (``torch._int_mm``, oneDNN) were tried and measured slower in the model on the CPU
    at hand (docs/benchmarks.md, "P18")."""

    name = "compressed-tensors-w8a8"
    loads = "compressed-tensors int-quantized and float-quantized checkpoints"

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        scheme = query.quantized_checkpoint
        if scheme is not None and query.num_experts and scheme.activations:
            return ["a mixture-of-experts model's experts with quantized activations (W8A8) are not served yet"]
        return super().unsupported_reasons(query)

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        dtype = torch.int8 if self.scheme.weight_type == "int" else torch.float8_e4m3fn
        rows: dict[Any, int] = {}  # each projection's rows in the checkpoint, from its weight
        waiting: dict[Any, torch.Tensor] = {}  # a per-tensor scale that came before its weight

        def load_weight(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            rows[shard_id] = loaded.shape[0]
            weight_loader(param, loaded, shard_id)
            if shard_id in waiting:
                load_scale(cast(nn.Parameter, layer.weight_scale), waiting.pop(shard_id), shard_id)

        def load_scale(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            scale = _tensor(loaded).float().reshape(-1)
            if scale.numel() == 1:  # by tensor: one scale for each of the projection's rows
                if shard_id not in rows:
                    waiting[shard_id] = scale
                    return
                scale = scale.expand(rows[shard_id]).contiguous()
            weight_loader(param, scale, shard_id)

        _register(layer, "weight", torch.empty(out_features, in_features, dtype=dtype), load_weight)
        # One dimension: replicated where tensor parallelism splits the inputs, sliced with the rows elsewhere.
        _register(layer, "weight_scale", torch.empty(out_features, dtype=torch.float32), load_scale)
        if self.scheme.activations == "tensor":
            _register(layer, "input_scale", torch.zeros(1, dtype=torch.float32), _load_largest)

    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        return ("weight", "weight_scale")

    def dense_weight(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        weight, scale = tensors["weight"].float(), tensors["weight_scale"].float()
        return weight * (scale if scale.dim() == 2 else scale.reshape(-1, 1))

    def _rounded(self, x: torch.Tensor, stored: torch.Tensor | None) -> torch.Tensor:
        """``x`` rows as the checkpoint's arithmetic sees them (in ``x``'s dtype): each
        row's scale its largest magnitude over 127.5 (int8) or 448 (float8), or the
        stored one; rounded to nearest (float8: e4m3's nearest even) and clamped."""
        rows = x.float()
        top = 127.5 if self.scheme.weight_type == "int" else 448.0
        scale = stored if stored is not None else rows.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / top
        if self.scheme.weight_type == "int":
            values = torch.round(rows / scale).clamp(-128, 127)
        else:
            values = (rows / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        return (values * scale).to(x.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.scheme.activations is None:
            return super().apply(layer, x, bias)
        stored = cast(torch.Tensor, layer.input_scale) if self.scheme.activations == "tensor" else None
        rows = self._rounded(x.reshape(-1, x.shape[-1]), stored)
        return super().apply(layer, rows, bias).reshape(*x.shape[:-1], -1)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if self.scheme.activations is not None:
            return None  # the input is rounded first: apply, then the elementwise backend's silu_and_mul
        return super().apply_silu_and_mul(layer, x, bias)


def _load_largest(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    """A static activation scale: the largest of those the fused projections store."""
    param.data.copy_(torch.maximum(param.data, _tensor(loaded).float().reshape(1)))
