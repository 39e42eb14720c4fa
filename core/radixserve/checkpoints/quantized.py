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


def _compressed_tensors(fields: Fields) -> QuantizedCheckpoint:
    """llm-compressor's compressed-tensors: served are its ``pack-quantized`` integer
    weights (W4A16, W8A16), one config group over every Linear, by group or by channel."""
    groups = fields.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups: {len(groups)} groups (served: one, over every Linear)")
    ((name, group),) = groups.items()
    where = f"quantization_config.config_groups.{name}"
    packing = group.get("format") or fields.get("format")
    if packing != "pack-quantized":
        raise ValueError(f"quantization_config.format: {packing!r} is not served; served: pack-quantized")
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{where}.targets: {group.get('targets')!r} (served: ['Linear'])")
    if group.get("input_activations"):
        raise ValueError(f"{where}.input_activations: quantized activations are not served yet (W4A16, W8A16 are)")
    ignored = [module for module in fields.get("ignore") or [] if module != "lm_head"]
    if ignored:
        raise ValueError(f"quantization_config.ignore: {ignored} (served: lm_head alone left unquantized)")
    weights = group.get("weights") or {}
    if weights.get("type", "int") != "int" or weights.get("dynamic"):
        raise ValueError(
            f"{where}.weights: {weights.get('type')!r} weights, dynamic {weights.get('dynamic')} (served: int, static)"
        )
    if weights.get("actorder"):
        raise ValueError(f"{where}.weights.actorder: {weights['actorder']!r} is not served yet")
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
    """A GGUF file's projections (checkpoints/gguf.py writes this config): blocks of 32
    with a scale each, values about the middle of their range."""
    kind = fields.get("linear_type")
    bits = {"Q4_0": 4, "Q8_0": 8}.get(str(kind))
    if bits is None:
        raise ValueError(f"quantization_config.linear_type: GGUF {kind!r} is not served; served: Q4_0, Q8_0")
    return QuantizedCheckpoint("gguf", bits, 32, symmetric=True)


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
