"""Checkpoints that ship quantized: what config.json's ``quantization_config`` says,
as a ``QuantizedCheckpoint``, and the quantization method that loads it. A format or
setting not served is an error naming the field and what is served."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixserve.kernels.query import QuantizedCheckpoint

# quant_method -> the bit widths served
SERVED_FORMATS: dict[str, tuple[int, ...]] = {"gptq": (4, 8), "awq": (4,)}


def _field(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` present (AWQ's configs spell some fields two ways)."""
    for name in names:
        if name in config:
            return config[name]
    return default


def checkpoint_quantization(config: Any) -> QuantizedCheckpoint | None:
    """The scheme of ``config``'s (a transformers config) quantized weights; None when it
    has no ``quantization_config``. ValueError naming the field it cannot serve."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    fields = raw if isinstance(raw, Mapping) else raw.to_dict()
    method = str(fields.get("quant_method", "")).lower()
    if method not in SERVED_FORMATS:
        served = ", ".join(SERVED_FORMATS)
        raise ValueError(f"quantization_config.quant_method: {method or 'unset'!r} is not served; served: {served}")
    bits = int(_field(fields, "bits", "w_bit", default=0))
    if bits not in SERVED_FORMATS[method]:
        widths = ", ".join(map(str, SERVED_FORMATS[method]))
        raise ValueError(f"quantization_config.bits: {bits}-bit {method} is not served; served: {widths}")
    group_size = int(_field(fields, "group_size", "q_group_size", default=-1))
    if group_size != -1 and (group_size <= 0 or group_size % 8):
        raise ValueError(f"quantization_config.group_size: {group_size} (a positive multiple of 8, or -1)")
    if method == "gptq":
        # GPTQ's own checkpoint format ("gptq", v1) stores each zero point less one; "gptq_v2" does not.
        version = str(_field(fields, "checkpoint_format", default="gptq"))
        if version not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format: {version!r} (served: gptq, gptq_v2)")
        return QuantizedCheckpoint(
            method,
            bits,
            group_size,
            symmetric=bool(fields.get("sym", True)),
            desc_act=bool(fields.get("desc_act", False)),
            zero_offset=1 if version == "gptq" else 0,
        )
    version = str(fields.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version: AWQ's {version!r} packing is not served; served: gemm")
    if not fields.get("zero_point", True):
        raise ValueError("quantization_config.zero_point: AWQ without zero points is not served; served: true")
    return QuantizedCheckpoint(method, bits, group_size, symmetric=False)


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
