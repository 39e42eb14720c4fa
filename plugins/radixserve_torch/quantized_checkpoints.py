"""Checkpoints that ship quantized: GPTQ (4 and 8 bit), AWQ (4 bit, GEMM packing),
compressed-tensors ``pack-quantized`` (4 and 8 bit), GGUF's Q4_0 and Q8_0 projections
(checkpoints/gguf.py reads them), all weight-only with activations in the model dtype
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
batch 1 on the layer's shape, timed once per shape at load; where neither beats the
GEMM backend on the dequantized weight (ATen's kernel on a CPU without AVX-512), and
for float32 models, 8-bit weights and other group sizes, the weight is dequantized
once at load and computed as a dense one.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch
from torch import nn

from radixserve.kernels import GemmBackend, KernelQuery, QuantizationMethod, QuantizedCheckpoint
from radixserve.kernels.quantization import WeightLoader
from radixserve.layers.weights import CheckpointTensor
from radixserve_torch import cpu_kernels

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


class QuantizedCheckpointMethod(QuantizationMethod):
    """A weight-only method for a checkpoint that ships quantized; ``name`` is the
    ``quant_method`` of config.json's ``quantization_config`` it loads."""

    priority = 0
    # The checkpoint's names of the packed integers, the zero points and the scales.
    tensor_names: ClassVar[tuple[str, str, str]] = ("qweight", "qzeros", "scales")

    def __init__(self, query: KernelQuery, gemm: GemmBackend):
        super().__init__(query, gemm)
        # The int4 kernel each shape (out, in, group) runs, None: dequantized; timed once.
        self._int4_choice: dict[tuple[int, int, int], type[Int4Kernel] | None] = {}

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        scheme = query.quantized_checkpoint
        if scheme is None or scheme.method != cls.name:
            return [f"loads {cls.name} checkpoints only (config.json's quantization_config names the method)"]
        if query.num_experts:
            return [f"a mixture-of-experts model's quantized experts ({cls.name}) are not served yet"]
        return []

    @property
    def scheme(self) -> QuantizedCheckpoint:
        scheme = self.query.quantized_checkpoint
        assert scheme is not None  # unsupported_reasons refuses a query without one
        return scheme

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
        shapes = {
            integers: ((out_features, in_features), torch.uint8),
            zeros: ((out_features, in_features // group), torch.uint8),
            scales: ((out_features, in_features // group), torch.float32),
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
            weight_loader(param, self.out_major(name, _tensor(loaded)), shard_id)

        return load

    def out_major(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as the out-major parameter ``name`` holds it."""
        raise NotImplementedError

    def zero_points_stored(self) -> bool:
        """Whether the checkpoint stores zero points (else each is the middle of the range)."""
        return True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        integers, zero_points, scale_name = self.tensor_names
        qweight = cast(torch.Tensor, getattr(layer, integers)).data
        scales = cast(torch.Tensor, getattr(layer, scale_name)).data
        if self.zero_points_stored():
            zeros = cast(torch.Tensor, getattr(layer, zero_points)).data
            delattr(layer, zero_points)
        else:
            zeros = torch.full(scales.shape, 1 << (self.scheme.bits - 1), dtype=torch.uint8, device=scales.device)
        group = qweight.shape[1] // scales.shape[1]
        delattr(layer, integers)
        delattr(layer, scale_name)
        order = self.input_order(layer, group)
        if order is not None:  # the inputs reordered so that each group's are contiguous
            qweight = qweight[:, order]
            layer.register_buffer("input_order", order)
        kernels = self.int4_kernels(qweight.shape, group)
        if kernels:
            chosen = self._fastest(kernels, qweight, zeros, scales, group)
            if chosen is not None:
                layer.int4 = chosen.pack(qweight, zeros, scales, group)  # type: ignore[assignment]  # CPU-only
                return
        # Elsewhere the weight is dequantized once, here, and the GEMM backend computes
        # with it as with any dense weight: as fast as the model dtype, not as small.
        dense = dequantize(qweight, zeros, scales).to(self.query.dtype)
        layer.register_buffer("weight", self.gemm.prepare_weight(dense))

    def int4_kernels(self, shape: torch.Size, group: int) -> list[type[Int4Kernel]]:
        """The int4 kernels that can compute a layer of ``shape`` ([out, in]) here: 4-bit
        weights of a bfloat16 model on the CPU, and what each kernel needs besides."""
        query = self.query
        if self.scheme.bits != 4 or query.device != "cpu" or query.dtype != torch.bfloat16:
            return []
        return [kernel for kernel in (NibbleStrips, AtenInt4) if kernel.serves(shape, group)]

    def _fastest(
        self,
        kernels: list[type[Int4Kernel]],
        qweight: torch.Tensor,
        zeros: torch.Tensor,
        scales: torch.Tensor,
        group: int,
    ) -> type[Int4Kernel] | None:
        """The fastest of ``kernels`` on this layer's shape at batch 1 (the memory-bound
        case they are for), or None where the GEMM backend on the dequantized weight is
        faster; timed once per shape. ATen's kernel is 4x faster than bfloat16 with
        AVX-512, about even with AVX2, and without either (its scalar path) many times
        slower: there the weights are dequantized."""
        shape = (qweight.shape[0], qweight.shape[1], group)
        if shape not in self._int4_choice:
            x = torch.randn(1, qweight.shape[1], dtype=self.query.dtype)
            dense = self.gemm.prepare_weight(dequantize(qweight, zeros, scales).to(self.query.dtype))
            times = {f"dequantized ({self.gemm.name})": _best_time(self.gemm.linear, x, dense)}
            for kernel in kernels:
                times[kernel.name] = _best_time(kernel.pack(qweight, zeros, scales, group).matmul, x)
            best = min(times, key=times.__getitem__)
            self._int4_choice[shape] = next((k for k in kernels if k.name == best), None)
            logger.info(
                "%s: a %d x %d layer at batch 1: %s; using %s",
                self.name,
                shape[0],
                shape[1],
                ", ".join(f"{name} {seconds * 1e3:.3f} ms" for name, seconds in times.items()),
                best,
            )
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


def _best_time(run: Callable[..., object], *args: object, repeats: int = 5) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``run(*args)``, after one to warm up."""
    run(*args)
    best = float("inf")
    for _ in range(repeats):
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


class NibbleStrips(Int4Kernel):
    """radixserve's own int4 kernel (csrc/cpu_int4.cpp, AVX512-BF16), which streams the
    nibbles in strips of 16 output columns: ``packed`` ``[out/16, in/8, 64]`` uint8,
    scales and offsets ``[out/16, in/group, 16]`` float32 (the layout is the kernel's;
    its offsets carry the 136 that its bfloat16 weights, 128 + q, add to q - 8)."""

    name = "radixserve int4"

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int):
        self.packed, self.scales, self.offsets, self.group = packed, scales, offsets, group

    @classmethod
    def serves(cls, shape: torch.Size, group: int) -> bool:
        if shape[0] % 16 or group % 8:
            return False
        try:
            cpu_kernels.load()
        except cpu_kernels.KernelBuildError:
            return False  # the other paths serve: which one is logged at the choice
        return bool(torch.ops.radixserve_cpu_int4.available())

    @classmethod
    def pack(cls, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> NibbleStrips:
        out, inputs = qweight.shape
        # (strip, column, chunk, i, j) -> (strip, chunk, lane = 2 column + j, nibble i)
        q = qweight.view(out // 16, 16, inputs // 8, 4, 2).permute(0, 2, 1, 4, 3).to(torch.int32)
        lanes = (q[..., 0] | q[..., 1] << 4 | q[..., 2] << 8 | q[..., 3] << 12).reshape(out // 16, inputs // 8, 32)
        packed = lanes.to(torch.int16).view(torch.uint8).contiguous()  # little-endian 16-bit lanes

        def by_strip(values: torch.Tensor) -> torch.Tensor:
            return values.float().view(out // 16, 16, -1).transpose(1, 2).contiguous()

        scales = scales.float()
        offsets = (8 - zeros.float()) * scales - 136 * scales
        return cls(packed, by_strip(scales), by_strip(offsets), group)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.packed.shape[0] * 16, dtype=torch.bfloat16)
        torch.ops.radixserve_cpu_int4.linear(x.contiguous(), self.packed, self.scales, self.offsets, self.group, out)
        return out


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
    """A GGUF file's ``Q4_0`` or ``Q8_0`` projections, which checkpoints/gguf.py reads
    already out-major: ``qweight`` (the value plus 8 or 128), ``qzeros`` (that 8 or 128)
    and ``scales``, blocks of 32 inputs."""

    name = "gguf"

    def out_major(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        return loaded


class FP8Blocks(QuantizationMethod):
    """FP8 checkpoints with block scales (config.json's ``quant_method: fp8`` with a
    ``weight_block_size``, as DeepSeek-V3 and Qwen3 ship them): ``weight`` float8 e4m3
    ``[out, in]`` and ``weight_scale_inv`` ``[out / B, in / B]`` (rounded up), the scale
    of each B x B block, which multiplies it. A CPU has no FP8 arithmetic: the weight is
    dequantized once at load and computed as a dense one (as fast as the model dtype,
    not smaller). The scales are kept row by row while loading (``[out, in / B]``) so
    that the layers' own loaders slice them as they slice the weight."""

    name = "fp8_block"
    priority = 0

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        scheme = query.quantized_checkpoint
        if scheme is None or scheme.method != cls.name:
            return ["loads FP8 checkpoints with block scales only (config.json's quantization_config)"]
        if query.num_experts:
            return [f"a mixture-of-experts model's quantized experts ({cls.name}) are not served yet"]
        return []

    @property
    def block(self) -> int:
        scheme = self.query.quantized_checkpoint
        assert scheme is not None  # unsupported_reasons refuses a query without one
        return scheme.group_size

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

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = cast(torch.Tensor, layer.weight).data
        scales = cast(torch.Tensor, layer.weight_scale_inv).data
        del layer.weight, layer.weight_scale_inv
        per_input = scales.repeat_interleave(self.block, dim=1)[:, : weight.shape[1]]
        dense = (weight.float() * per_input).to(self.query.dtype)
        layer.register_buffer("weight", self.gemm.prepare_weight(dense))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemm.linear(x, cast(torch.Tensor, layer.weight), bias)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return self.gemm.linear_silu_and_mul(x, cast(torch.Tensor, layer.weight), bias)
