"""Checkpoints that ship quantized: GPTQ (4 and 8 bit) and AWQ (4 bit, GEMM packing),
weight-only with activations in the model dtype (W4A16, W8A16).

Loading turns each checkpoint tensor into the same out-major form whatever the format,
so that the linear layers' own loaders (tensor-parallel slices, fused q/k/v and
gate/up shards) apply unchanged: ``qweight`` ``[out, in]`` of unsigned integers
(one a byte), ``scales`` ``[out, groups]`` and ``qzeros`` ``[out, groups]``; a weight
is ``(qweight - qzeros) * scales`` over its group of ``group_size`` inputs.

After loading, 4-bit weights of a bfloat16 model go to ATen's int4 CPU kernel
(``torch._weight_int4pack_mm_for_cpu``: weights repacked once, dequantized in
registers, groups of 32 to 256), which reads a quarter of the bytes of bfloat16
weights: what batch-1 decode, bound by memory, is paced by. Elsewhere (float32
models, 8-bit, other group sizes) the weight is dequantized on each forward (the
reference semantics: right, not fast).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from radixserve.kernels import KernelQuery, QuantizationMethod, QuantizedCheckpoint
from radixserve.kernels.quantization import WeightLoader
from radixserve.layers.weights import CheckpointTensor

# AWQ's GEMM packing puts output column 8c + ORDER[i] in nibble i of word c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)


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
        shapes = {
            "qweight": ((out_features, in_features), torch.uint8),
            "qzeros": ((out_features, in_features // group), torch.uint8),
            "scales": ((out_features, in_features // group), torch.float32),
        }
        for name, (shape, dtype) in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = self._converting(name, weight_loader)  # type: ignore[attr-defined]
            layer.register_parameter(name, param)

    def _converting(self, name: str, weight_loader: WeightLoader) -> WeightLoader:
        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            weight_loader(param, self.out_major(name, _tensor(loaded)), shard_id)

        return load

    def out_major(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as the out-major parameter ``name`` holds it."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight = cast(torch.Tensor, layer.qweight).data
        scales = cast(torch.Tensor, layer.scales).data
        zeros = cast(torch.Tensor, layer.qzeros).data
        group = qweight.shape[1] // scales.shape[1]
        del layer.qweight, layer.scales, layer.qzeros
        order = self.input_order(layer, group)
        if order is not None:  # the inputs reordered so that each group's are contiguous
            qweight = qweight[:, order]
            layer.register_buffer("input_order", order)
        if self.int4_kernel_serves(group):
            # ATen's kernel computes (q - 8) * scale + offset: the offset is (8 - zero) * scale.
            packed = torch._convert_weight_to_int4pack_for_cpu(qweight.to(torch.int32), 2)
            offsets = (8 - zeros.float()) * scales
            scales_and_offsets = torch.stack([scales.t(), offsets.t()], dim=-1).to(torch.bfloat16).contiguous()
            layer.register_buffer("int4_weight", packed)
            layer.register_buffer("int4_scales_and_offsets", scales_and_offsets)
            layer.int4_group_size = group  # type: ignore[assignment]  # a plain attribute beside the buffers
            return
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("weight_scales", scales)
        layer.register_buffer("weight_zeros", zeros)

    def int4_kernel_serves(self, group: int) -> bool:
        """Whether ATen's int4 CPU kernel computes this layer: 4-bit weights, a bfloat16
        model on the CPU, groups of 32 to 256."""
        query = self.query
        return (
            self.scheme.bits == 4
            and query.device == "cpu"
            and query.dtype == torch.bfloat16
            and group in INT4PACK_GROUP_SIZES
        )

    def input_order(self, layer: nn.Module, group: int) -> torch.Tensor | None:
        """The order of the inputs that puts each group's together (None: they are)."""
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if hasattr(layer, "input_order"):
            x = x.index_select(-1, cast(torch.Tensor, layer.input_order))
        if hasattr(layer, "int4_weight"):
            flat = x.reshape(-1, x.shape[-1])
            out = torch._weight_int4pack_mm_for_cpu(
                flat,
                cast(torch.Tensor, layer.int4_weight),
                cast(int, layer.int4_group_size),
                cast(torch.Tensor, layer.int4_scales_and_offsets),
            )
            out = out.reshape(*x.shape[:-1], out.shape[-1])
            return out if bias is None else out + bias
        weight = dequantize(
            cast(torch.Tensor, layer.qweight),
            cast(torch.Tensor, layer.weight_zeros),
            cast(torch.Tensor, layer.weight_scales),
        )
        return self.gemm.linear(x, weight.to(x.dtype), bias)


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

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        super().create_weights(layer, in_features, out_features, params_dtype, weight_loader)
        g_idx = nn.Parameter(torch.empty(in_features, dtype=torch.int32), requires_grad=False)
        g_idx.weight_loader = self._load_g_idx  # type: ignore[attr-defined]
        layer.register_parameter("g_idx", g_idx)

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
