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
from typing import Any

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
    if scheme.method == "compressed-tensors":
        return _compressed_tensors(weight, scheme)
    if scheme.method == "fp8_block":
        return _fp8_blocks(weight, scheme.group_size)
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


def _compressed_tensors(
    weight: torch.Tensor, scheme: QuantizedCheckpoint
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' own quantizer and packer (``pack-quantized``), and the weight
    its integers stand for: ``(q - zero_point) * scale``."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = compressed_tensors_args(scheme)
    out, inputs = weight.shape
    group = scheme.group_size if scheme.group_size != -1 else inputs
    grouped = weight.float().view(out, inputs // group, group)
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    state = {"weight": weight.float(), "weight_scale": scale, "weight_zero_point": zero_point}
    tensors = PackedQuantizationCompressor.compress(state, compressed_tensors_scheme(scheme))
    q = ct_quantize(x=weight.float(), scale=scale, zero_point=zero_point, args=args, dtype=torch.int8)
    dequantized = (q.float().view(out, -1, group) - zero_point.float()[..., None]) * scale[..., None]
    return dict(tensors), dequantized.view(out, inputs)


def _fp8_blocks(weight: torch.Tensor, block: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """float8 e4m3 in blocks of ``block`` x ``block``, each scaled by its largest value over
    448 (``weight_scale_inv``, which multiplies), as DeepSeek-V3's FP8 checkpoints are."""
    out, inputs = weight.shape
    rows, cols = -(-out // block), -(-inputs // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:out, :inputs] = weight.float()
    blocks = padded.view(rows, block, cols, block)
    scales = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    fp8 = (blocks / scales[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    dequantized = (fp8.float() * scales[:, None, :, None]).view(rows * block, cols * block)[:out, :inputs]
    weight_fp8 = fp8.view(rows * block, cols * block)[:out, :inputs].contiguous()
    return {"weight": weight_fp8, "weight_scale_inv": scales}, dequantized.contiguous()


def compressed_tensors_args(scheme: QuantizedCheckpoint) -> Any:
    """compressed-tensors' ``QuantizationArgs`` of ``scheme``'s weights."""
    from compressed_tensors.quantization import QuantizationArgs

    by_group = scheme.group_size != -1
    return QuantizationArgs(
        num_bits=scheme.bits,
        type="int",
        symmetric=scheme.symmetric,
        strategy="group" if by_group else "channel",
        group_size=scheme.group_size if by_group else None,
    )


def compressed_tensors_scheme(scheme: QuantizedCheckpoint) -> Any:
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=compressed_tensors_args(scheme))


def scheme_of(
    method: str, bits: int = 4, group: int = 32, sym: bool = False, desc_act: bool = False
) -> QuantizedCheckpoint:
    """The scheme ``write_quantized`` writes (GPTQ in its own format: zero points less one)."""
    if method == "gptq":
        return QuantizedCheckpoint("gptq", bits, group, sym, desc_act=desc_act, zero_offset=1)
    if method == "compressed-tensors":
        return QuantizedCheckpoint(method, bits, group, sym)
    if method == "fp8_block":
        return QuantizedCheckpoint(method, 8, group, symmetric=True)
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
    config["quantization_config"] = _config(scheme)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def _config(scheme: QuantizedCheckpoint) -> dict[str, Any]:
    """config.json's ``quantization_config`` of ``scheme``, as each format's tool writes it."""
    bits, group = scheme.bits, scheme.group_size
    if scheme.method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "sym": scheme.symmetric,
            "desc_act": scheme.desc_act,
        }
    if scheme.method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    if scheme.method == "fp8_block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [group, group],
        }
    weights = compressed_tensors_args(scheme).model_dump(exclude_none=True)
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
    }


# ---- GGUF (llama.cpp's files) ----------------------------------------------------------------
def write_gguf(model_dir: Path, out_file: Path, linear_type: str) -> None:
    """``model_dir`` (a Llama, one safetensors file) as a GGUF file, as llama.cpp's converter
    writes it: its config as ``llama.*`` metadata, q_proj and k_proj rows permuted, the
    decoder's projections quantized to ``linear_type`` (``Q4_0``, ``Q8_0``) by the ``gguf``
    package, every other tensor float32; the tokenizer (a byte-level BPE, the tiny
    models') as llama.cpp's ``gpt2`` vocabulary: its tokens, types and merges."""
    import gguf

    from radixserve.checkpoints.gguf import gguf_name, llama_cpp_permute

    config = json.loads((model_dir / "config.json").read_text())
    qtype = gguf.GGMLQuantizationType[linear_type]
    writer = gguf.GGUFWriter(str(out_file), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, model_dir)
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        weight = tensor.float()
        if name.endswith("q_proj.weight"):
            weight = llama_cpp_permute(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = llama_cpp_permute(weight, config["num_key_value_heads"])
        if name.rsplit(".", 2)[-2] in PROJECTIONS:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(weight.numpy(), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), weight.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer: Any, model_dir: Path) -> None:
    """``model_dir``'s byte-level BPE tokenizer (tokenizer.json) as GGUF metadata."""
    import gguf

    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {added["content"]: added["id"] for added in spec.get("added_tokens", [])}
    tokens = [""] * (max([*vocab.values(), *special.values()]) + 1)
    for token, index in {**vocab, **special}.items():
        tokens[index] = token
    kinds = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_token_merges(merges)
    for role, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id)):
        if config.get(role) in special:
            add(special[config[role]])
