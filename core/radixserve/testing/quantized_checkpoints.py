"""Quantized checkpoints made offline, by each format's own layout, from a random-weight
model (the tests' and the benchmarks'): every linear weight of the decoder quantized in groups along its input
(round to nearest; asymmetric, or symmetric about the middle of the range), packed as
GPTQ (AutoGPTQ's format: ``qweight`` words along the input, ``qzeros`` stored less
one) or AWQ (AutoAWQ's GEMM format: words along the output, interleaved), with
``quantization_config`` in config.json. Beside each, the same model with the
dequantized weights in float32: what HF transformers runs as the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from radixserve.kernels.query import QuantizedCheckpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column 8c + AWQ_ORDER[i]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(
    weight: torch.Tensor, bits: int, group: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` -> integers ``[out, in]``, zero points and float16 scales
    ``[out, in / group]``."""
    out, inputs = weight.shape
    top = 2**bits - 1
    grouped = weight.float().view(out, inputs // group, group)
    if symmetric:
        scales = grouped.abs().amax(-1) * 2 / top
        zeros = torch.full(scales.shape, (top + 1) // 2, dtype=torch.int64)
    else:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scales = (high - low) / top
        zeros = torch.round(-low / scales.clamp(min=1e-8)).to(torch.int64).clamp(0, top)
    scales = scales.clamp(min=1e-8).half()
    q = torch.round(grouped / scales.float()[..., None]).to(torch.int64) + zeros[..., None]
    return q.clamp(0, top).view(out, inputs), zeros, scales


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out, groups = scales.shape
    grouped = q.view(out, groups, -1).float() - zeros.float()[..., None]
    return (grouped * scales.float()[..., None]).view(out, -1)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[rows, cols]`` -> int32 ``[rows / per, cols]``, row ``per * r + i`` in bits ``i * bits``."""
    per = 32 // bits
    words = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for i in range(per):
        words |= values[i::per].to(torch.int64) << (i * bits)
    return _as_int32(words)


def pack_columns(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[rows, cols]`` -> int32 ``[rows, cols / per]``, column ``per * c + order[i]`` in bits ``i * bits``."""
    per = 32 // bits
    order = order or tuple(range(per))
    words = torch.zeros(values.shape[0], values.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        words |= values[:, order[i] :: per].to(torch.int64) << (i * bits)
    return _as_int32(words)


def _shared_input(module: str) -> str:
    """Projections that read the same input (q/k/v; gate/up) share a key."""
    parent, projection = module.rsplit(".", 1)
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    return f"{parent}.{shared.get(projection, projection)}"


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_weight(
    weight: torch.Tensor, scheme: QuantizedCheckpoint, order: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``weight`` ``[out, in]`` quantized by ``scheme`` and packed as its format's tensors
    (by their names in the checkpoint: ``qweight``, ``qzeros``, ``scales``, GPTQ's
    ``g_idx``), and the dequantized weight (float32) those tensors stand for. ``order``
    (act-order): the order of the inputs in which groups are formed."""
    out, inputs = weight.shape
    bits, group = scheme.bits, scheme.group_size if scheme.group_size != -1 else weight.shape[1]
    order = torch.arange(inputs) if order is None else order
    q_ordered, zeros, scales = quantize(weight.float()[:, order], bits, group, scheme.symmetric)
    q = torch.empty_like(q_ordered)
    q[:, order] = q_ordered
    dequantized = torch.empty(out, inputs)
    dequantized[:, order] = dequantize(q_ordered, zeros, scales)
    if scheme.method == "gptq":
        g_idx = torch.empty(inputs, dtype=torch.int32)
        g_idx[order] = (torch.arange(inputs) // group).to(torch.int32)
        tensors = {
            "qweight": pack_rows(q.t(), bits),
            "qzeros": pack_columns(zeros.t() - scheme.zero_offset, bits),
            "scales": scales.t().contiguous(),
            "g_idx": g_idx,
        }
    else:
        tensors = {
            "qweight": pack_columns(q.t(), bits, AWQ_ORDER),
            "qzeros": pack_columns(zeros.t(), bits, AWQ_ORDER),
            "scales": scales.t().contiguous(),
        }
    return tensors, dequantized


def scheme_of(
    method: str, bits: int = 4, group: int = 32, sym: bool = False, desc_act: bool = False
) -> QuantizedCheckpoint:
    """The scheme ``write_quantized`` writes (GPTQ in its own format: zero points less one)."""
    if method == "gptq":
        return QuantizedCheckpoint("gptq", bits, group, sym, desc_act=desc_act, zero_offset=1)
    return QuantizedCheckpoint("awq", bits, group, symmetric=False)


def write_quantized(
    model_dir: Path,
    out_dir: Path,
    reference_dir: Path,
    method: str,
    bits: int = 4,
    group: int = 32,
    sym: bool = False,
    desc_act: bool = False,
) -> None:
    """``model_dir`` (one safetensors file) quantized as ``method`` into ``out_dir``, and
    dequantized into ``reference_dir``; both keep its config and tokenizer. ``desc_act``
    (GPTQ): groups formed over the inputs in a random order, one order per input that
    projections share (q/k/v, gate/up), as GPTQ's act-order forms them."""
    scheme = scheme_of(method, bits, group, sym, desc_act)
    for target in (out_dir, reference_dir):
        shutil.copytree(model_dir, target)
        for old in target.glob("*.safetensors*"):
            old.unlink()
    tensors = load_file(model_dir / "model.safetensors")
    packed: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    orders: dict[str, torch.Tensor] = {}  # by the input projections share
    gen = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS):
            packed[name] = dense[name] = tensor
            continue
        order = None
        if desc_act:
            order = orders.setdefault(_shared_input(module), torch.randperm(tensor.shape[1], generator=gen))
        parts, dense[name] = pack_weight(tensor, scheme, order)
        packed.update({f"{module}.{part}": value for part, value in parts.items()})
    save_file({k: v.contiguous() for k, v in packed.items()}, out_dir / "model.safetensors")
    save_file({k: v.contiguous() for k, v in dense.items()}, reference_dir / "model.safetensors")
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act}
        if method == "gptq"
        else {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
