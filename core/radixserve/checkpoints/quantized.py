"""Checkpoints that ship quantized: what config.json's ``quantization_config`` says,
as a ``QuantizedCheckpoint``, and the quantization method that loads it. A format or
setting not served is an error naming the field and what is served."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from radixserve.kernels.query import QuantizedCheckpoint

Fields = Mapping[str, Any]


def _field(config: Fields, *names: str, default: Any = None) -> Any:
    """The first of ``names`` present (AWQ's configs spell some fields two ways)."""
    for name in names:
        if name in config:
            return config[name]
    return default


def _bits(value: Any, served: tuple[int, ...], method: str, field: str = "bits") -> int:
    bits = int(value or 0)
    if bits not in served:
        widths = ", ".join(map(str, served))
        raise ValueError(f"quantization_config.{field}: {bits}-bit {method} is not served; served: {widths}")
    return bits


def _group_size(value: Any, field: str = "group_size") -> int:
    group_size = int(-1 if value is None else value)
    if group_size != -1 and (group_size <= 0 or group_size % 8):
        raise ValueError(f"quantization_config.{field}: {group_size} (a positive multiple of 8, or -1)")
    return group_size


def _gptq(fields: Fields) -> QuantizedCheckpoint:
    # GPTQ's own checkpoint format ("gptq", v1) stores each zero point less one; "gptq_v2" does not.
    version = str(_field(fields, "checkpoint_format", default="gptq"))
    if version not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format: {version!r} (served: gptq, gptq_v2)")
    return QuantizedCheckpoint(
        "gptq",
        _bits(fields.get("bits"), (4, 8), "gptq"),
        _group_size(fields.get("group_size", -1)),
        symmetric=bool(fields.get("sym", True)),
        desc_act=bool(fields.get("desc_act", False)),
        zero_offset=1 if version == "gptq" else 0,
    )


def _awq(fields: Fields) -> QuantizedCheckpoint:
    version = str(fields.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version: AWQ's {version!r} packing is not served; served: gemm")
    if not fields.get("zero_point", True):
        raise ValueError("quantization_config.zero_point: AWQ without zero points is not served; served: true")
    return QuantizedCheckpoint(
        "awq",
        _bits(_field(fields, "bits", "w_bit"), (4,), "awq"),
        _group_size(_field(fields, "group_size", "q_group_size", default=-1)),
        symmetric=False,
    )


def _always_float(module: str) -> bool:
    """Whether ``module`` (a name or llm-compressor's ``re:`` pattern in ``ignore``) names
    layers radixserve never quantizes: the LM head, or a mixture-of-experts router
    (``mlp.gate``, Mixtral's ``block_sparse_moe.gate``)."""
    return module == "lm_head" or module.removesuffix("$").endswith(("mlp.gate", "block_sparse_moe.gate"))


def _compressed_tensors(fields: Fields) -> QuantizedCheckpoint:
    """llm-compressor's compressed-tensors: one config group over every Linear; served
    are its ``pack-quantized`` integer weights (W4A16, W8A16) by group or by channel, and
    its 8-bit ``int-quantized`` and ``float-quantized`` weights (by channel or tensor),
    with activations left alone or quantized like them (W8A8: per token, dynamic; or
    per tensor, by a stored scale)."""
    groups = fields.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups: {len(groups)} groups (served: one, over every Linear)")
    ((name, group),) = groups.items()
    where = f"quantization_config.config_groups.{name}"
    packing = group.get("format") or fields.get("format")
    if packing not in ("pack-quantized", "int-quantized", "float-quantized"):
        raise ValueError(
            f"quantization_config.format: {packing!r} is not served; served: pack-quantized, int-quantized, "
            "float-quantized"
        )
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{where}.targets: {group.get('targets')!r} (served: ['Linear'])")
    ignored = [module for module in fields.get("ignore") or [] if not _always_float(module)]
    if ignored:
        raise ValueError(
            f"quantization_config.ignore: {ignored} (served: the LM head and MoE routers alone left unquantized)"
        )
    weights = group.get("weights") or {}
    if weights.get("actorder"):
        raise ValueError(f"{where}.weights.actorder: {weights['actorder']!r} is not served yet")
    if packing != "pack-quantized":
        return _compressed_tensors_8bit(where, packing, weights, group.get("input_activations"))
    if group.get("input_activations"):
        raise ValueError(
            f"{where}.input_activations: quantized activations with pack-quantized weights are not served "
            "(W4A16, W8A16 are; W8A8 is int-quantized or float-quantized)"
        )
    if weights.get("type", "int") != "int" or weights.get("dynamic"):
        raise ValueError(
            f"{where}.weights: {weights.get('type')!r} weights, dynamic {weights.get('dynamic')} (served: int, static)"
        )
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"{where}.weights.strategy: {strategy!r} is not served; served: group, channel")
    return QuantizedCheckpoint(
        "compressed-tensors",
        _bits(weights.get("num_bits"), (4, 8), "compressed-tensors", f"config_groups.{name}.weights.num_bits"),
        _group_size(
            weights.get("group_size") if strategy == "group" else -1, f"config_groups.{name}.weights.group_size"
        ),
        symmetric=bool(weights.get("symmetric", True)),
    )


def _compressed_tensors_8bit(where: str, packing: str, weights: Fields, inputs: Fields | None) -> QuantizedCheckpoint:
    """``int-quantized`` (int8) or ``float-quantized`` (float8 e4m3) weights, symmetric, by
    channel or tensor; activations of the same type, per token (dynamic) or per tensor
    (static: each layer's ``input_scale``), or none."""
    kind = "int" if packing == "int-quantized" else "float"
    if weights.get("type", "int") != kind or int(weights.get("num_bits") or 0) != 8 or weights.get("dynamic"):
        raise ValueError(
            f"{where}.weights: {weights.get('num_bits')}-bit {weights.get('type')!r} weights, dynamic "
            f"{weights.get('dynamic')} in {packing} (served: 8-bit {kind}, static)"
        )
    if not weights.get("symmetric", True):
        raise ValueError(f"{where}.weights.symmetric: false is not served with {packing} (served: symmetric)")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise ValueError(
            f"{where}.weights.strategy: {strategy!r} is not served with {packing}; served: channel, tensor"
        )
    activations = None
    if inputs:
        served = {("token", True): "token", ("tensor", False): "tensor"}
        activations = served.get((str(inputs.get("strategy")), bool(inputs.get("dynamic"))))
        if (
            activations is None
            or inputs.get("type", "int") != kind
            or int(inputs.get("num_bits") or 0) != 8
            or not inputs.get("symmetric", True)
        ):
            raise ValueError(
                f"{where}.input_activations: {inputs.get('num_bits')}-bit {inputs.get('type')!r}, strategy "
                f"{inputs.get('strategy')!r}, dynamic {inputs.get('dynamic')}, symmetric {inputs.get('symmetric')} "
                f"(served: 8-bit {kind}, symmetric, by token dynamically or by tensor statically)"
            )
    return QuantizedCheckpoint(
        "compressed-tensors-w8a8",
        8,
        -1 if strategy == "channel" else 0,
        symmetric=True,
        weight_type=kind,
        activations=activations,
    )


def _fp8(fields: Fields) -> QuantizedCheckpoint:
    """FP8 weights with a scale per block of inputs and outputs, as DeepSeek-V3 and Qwen3's
    FP8 checkpoints ship them (``weight`` float8 e4m3, ``weight_scale_inv`` per block)."""
    if fields.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt: {fields['fmt']!r} is not served; served: e4m3")
    block = fields.get("weight_block_size")
    if not block:
        raise ValueError("quantization_config.weight_block_size: unset (FP8 by tensor or channel is not served yet)")
    if len(block) != 2 or block[0] != block[1] or int(block[0]) <= 0:
        raise ValueError(f"quantization_config.weight_block_size: {block} (served: square blocks)")
    ignored = [m for m in fields.get("modules_to_not_convert") or [] if m != "lm_head"]
    if ignored:
        raise ValueError(f"quantization_config.modules_to_not_convert: {ignored} (served: lm_head alone)")
    return QuantizedCheckpoint("fp8_block", 8, int(block[0]), symmetric=True)


def _gguf(fields: Fields) -> QuantizedCheckpoint:
    """A GGUF file's projections (checkpoints/gguf.py writes this config): their GGUF
    types, the most bits of any, the group size they are read at; zero points of any
    value (the types with a minimum have fractional ones); the output head's type where
    it is stored quantized too."""
    from radixserve.checkpoints.gguf import BLOCK_TYPES

    types = fields.get("linear_types") or []
    unknown = [kind for kind in types if kind not in BLOCK_TYPES]
    if not types or unknown:
        raise ValueError(
            f"quantization_config.linear_types: GGUF {unknown or types} not served; served: {', '.join(BLOCK_TYPES)}"
        )
    head = fields.get("lm_head_type")
    if head is not None and head not in BLOCK_TYPES:
        raise ValueError(f"quantization_config.lm_head_type: GGUF {head} not served; served: {', '.join(BLOCK_TYPES)}")
    bits, group = int(fields["bits"]), int(fields["group_size"])
    return QuantizedCheckpoint("gguf", bits, group, symmetric=False, lm_head=head is not None)


# quant_method -> how its quantization_config reads
FORMATS: dict[str, Callable[[Fields], QuantizedCheckpoint]] = {
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _compressed_tensors,
    "fp8": _fp8,
    "gguf": _gguf,
}


def checkpoint_quantization(config: Any) -> QuantizedCheckpoint | None:
    """The scheme of ``config``'s (a transformers config) quantized weights; None when it
    has no ``quantization_config``. ValueError naming the field it cannot serve."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    fields = raw if isinstance(raw, Mapping) else raw.to_dict()
    method = str(fields.get("quant_method", "")).lower()
    if method not in FORMATS:
        served = ", ".join(FORMATS)
        raise ValueError(f"quantization_config.quant_method: {method or 'unset'!r} is not served; served: {served}")
    return FORMATS[method](fields)


def resolve_quantization(config: Any, requested: str | None) -> tuple[str | None, QuantizedCheckpoint | None]:
    """The quantization method to run (``--quantization``, or the checkpoint's) and the
    checkpoint's scheme. A quantized checkpoint is loaded by its own method: naming
    another is an error naming both."""
    scheme = checkpoint_quantization(config)
    if scheme is None:
        return requested, None
    if requested not in (None, scheme.method):
        raise ValueError(
            f"quantization: --quantization {requested} for a {scheme.method} checkpoint "
            f"(config.json's quantization_config); leave it unset or name {scheme.method}"
        )
    return scheme.method, scheme
