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
# The linear layers quantized: attention's and the MLPs', the experts' included (Mixtral
# names an expert's gate, down and up w1, w2 and w3); routers and heads stay float.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


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
    shared |= {"w1": "gate_up", "w3": "gate_up"}
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
    if scheme.method == "compressed-tensors-w8a8":
        return _compressed_tensors_8bit(weight, scheme)
    if scheme.method == "fp8_block":
        return _fp8_blocks(weight, scheme.group_size)
    if scheme.method == "gguf":
        return _gguf_blocks(weight, scheme)
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


def _compressed_tensors_8bit(
    weight: torch.Tensor, scheme: QuantizedCheckpoint
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' own quantizer and compressor (``int-quantized``: int8;
    ``float-quantized``: float8 e4m3), by channel or tensor, and the weight the stored
    values stand for: ``weight * weight_scale``."""
    from compressed_tensors.compressors import FloatQuantizationCompressor, IntQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = compressed_tensors_args(scheme)
    rows = weight.float() if scheme.group_size == -1 else weight.float().reshape(1, -1)  # by channel or tensor
    low, high = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)
    scale, zero_point = calculate_qparams(low, high, args)
    if scheme.group_size == 0:
        scale, zero_point = scale.reshape(1), zero_point.reshape(1)
    compressor = IntQuantizationCompressor if scheme.weight_type == "int" else FloatQuantizationCompressor
    state = {"weight": weight.float(), "weight_scale": scale, "weight_zero_point": zero_point}
    tensors = dict(compressor.compress(state, compressed_tensors_scheme(scheme)))
    dequantized = tensors["weight"].float() * tensors["weight_scale"].float().reshape(-1, 1)
    return tensors, dequantized


def rounded_activations(scheme: QuantizedCheckpoint, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (float32) as a W8A8 checkpoint's layer sees it, by compressed-tensors'
    arithmetic: symmetric, each token's scale its largest magnitude over 127.5 (int8)
    or 448 (float8) -- or, for static scales, one for the whole tensor calibrated the
    same way on ``x`` (returned: the layer's ``input_scale``) -- rounded to nearest
    (float8: e4m3's nearest even) and clamped."""
    top = 127.5 if scheme.weight_type == "int" else 448.0
    static = scheme.activations == "tensor"
    largest = x.abs().amax().reshape(1) if static else x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(largest == 0, torch.finfo(torch.float32).eps, largest / top)
    if scheme.weight_type == "int":
        rounded = torch.round(x / scale).clamp(-128, 127) * scale
    else:
        rounded = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return rounded, scale if static else None


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


def _gguf_blocks(weight: torch.Tensor, scheme: QuantizedCheckpoint) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``weight`` as a GGUF file's blocks of the type ``gguf_type`` names, read as
    checkpoints/gguf.py reads a projection (``qweight``, ``qzeros``, ``scales`` at
    ``scheme.group_size``), and the weight the ``gguf`` package dequantizes them to."""
    import gguf

    from radixserve.checkpoints.gguf import read_blocks

    kind = gguf_type(scheme, weight.shape[1])
    data = quantize_gguf(weight, kind)
    dequantized = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).copy()).float()
    return read_blocks(data, kind, scheme.group_size), dequantized


def gguf_type(scheme: QuantizedCheckpoint, inputs: int) -> str:
    """The GGUF type the kit packs a ``gguf`` scheme's weight of ``inputs`` as: symmetric,
    ``Q4_0``/``Q5_0``/``Q8_0``; else the k-quant of the bits where ``inputs`` fills its
    blocks of 256 (``Q4_K``, ``Q5_K``), ``Q4_1``/``Q5_1`` where not (``Q8_0`` for 8 bits)."""
    if scheme.bits == 8:
        return "Q8_0"
    if scheme.symmetric:
        return f"Q{scheme.bits}_0"
    return f"Q{scheme.bits}_K" if inputs % 256 == 0 else f"Q{scheme.bits}_1"


def compressed_tensors_args(scheme: QuantizedCheckpoint) -> Any:
    """compressed-tensors' ``QuantizationArgs`` of ``scheme``'s weights."""
    from compressed_tensors.quantization import QuantizationArgs

    strategy = {-1: "channel", 0: "tensor"}.get(scheme.group_size, "group")
    return QuantizationArgs(
        num_bits=scheme.bits,
        type=scheme.weight_type,
        symmetric=scheme.symmetric,
        strategy=strategy,
        group_size=scheme.group_size if strategy == "group" else None,
    )


def compressed_tensors_activation_args(scheme: QuantizedCheckpoint) -> Any:
    """compressed-tensors' ``QuantizationArgs`` of ``scheme``'s activations (None: not quantized)."""
    from compressed_tensors.quantization import QuantizationArgs

    if scheme.activations is None:
        return None
    return QuantizationArgs(
        num_bits=8,
        type=scheme.weight_type,
        symmetric=True,
        strategy=scheme.activations,
        dynamic=scheme.activations == "token",
    )


def compressed_tensors_scheme(scheme: QuantizedCheckpoint) -> Any:
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(
        targets=["Linear"],
        weights=compressed_tensors_args(scheme),
        input_activations=compressed_tensors_activation_args(scheme),
    )


def scheme_of(
    method: str,
    bits: int = 4,
    group: int = 32,
    sym: bool = False,
    desc_act: bool = False,
    weight_type: str = "int",
    activations: str | None = None,
) -> QuantizedCheckpoint:
    """The scheme ``write_quantized`` writes (GPTQ in its own format: zero points less one;
    ``compressed-tensors-w8a8``: 8-bit ``weight_type`` weights by channel, ``group`` -1,
    or tensor, 0, symmetric, with ``activations`` None, ``token`` or ``tensor``)."""
    if method == "compressed-tensors-w8a8":
        return QuantizedCheckpoint(method, 8, group, True, weight_type=weight_type, activations=activations)
    if method == "gptq":
        return QuantizedCheckpoint("gptq", bits, group, sym, desc_act=desc_act, zero_offset=1)
    if method == "compressed-tensors":
        return QuantizedCheckpoint(method, bits, group, sym)
    if method == "fp8_block":
        return QuantizedCheckpoint(method, 8, group, symmetric=True)
    if method == "gguf":
        return QuantizedCheckpoint(method, bits, group, sym)
    return QuantizedCheckpoint("awq", bits, group, symmetric=False)


def write_quantized(model_dir: Path, out_dir: Path, reference_dir: Path, method: str, **scheme: Any) -> None:
    """``model_dir`` (one safetensors file) quantized as ``method`` into ``out_dir``, and
    dequantized into ``reference_dir``; both keep its config and tokenizer. ``scheme``:
    ``scheme_of``'s other arguments (bits, group, sym, desc_act, weight_type,
    activations). ``desc_act``
    (GPTQ): groups formed over the inputs in a random order, one order per input that
    projections share (q/k/v, gate/up), as GPTQ's act-order forms them. Static
    activation scales (``activations="tensor"``) are calibrated as llm-compressor's
    min-max observer does: the largest magnitude each layer's input takes over a few
    random prompts through the float model, over 127.5 (int8) or 448 (float8)."""
    checkpoint = scheme_of(method, **scheme)
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
        if checkpoint.desc_act:
            order = orders.setdefault(_shared_input(module), torch.randperm(tensor.shape[1], generator=gen))
        parts, dense[name] = pack_weight(tensor, checkpoint, order)
        packed.update({f"{module}.{part}": value for part, value in parts.items()})
    if checkpoint.activations == "tensor":
        top = 127.5 if checkpoint.weight_type == "int" else 448.0
        for module, largest in _largest_inputs(model_dir).items():
            packed[f"{module}.input_scale"] = torch.tensor([largest / top])
    save_file({k: v.contiguous() for k, v in packed.items()}, out_dir / "model.safetensors")
    save_file({k: v.contiguous() for k, v in dense.items()}, reference_dir / "model.safetensors")
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = _config(checkpoint)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def _largest_inputs(model_dir: Path, prompts: int = 4, length: int = 48) -> dict[str, float]:
    """The largest magnitude of each quantized projection's input over ``prompts`` random
    prompts through the float model (HF transformers, float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    largest: dict[str, float] = {}

    def record(name: str) -> Any:
        def hook(module: Any, inputs: tuple[torch.Tensor, ...]) -> None:
            largest[name] = max(largest.get(name, 0.0), float(inputs[0].abs().amax()))

        return hook

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            module.register_forward_pre_hook(record(name))
    ids = torch.randint(16, model.config.vocab_size, (prompts, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    return largest


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
    inputs = compressed_tensors_activation_args(scheme)
    packing = "pack-quantized"
    if scheme.method == "compressed-tensors-w8a8":
        packing = "int-quantized" if scheme.weight_type == "int" else "float-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": packing,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None if inputs is None else inputs.model_dump(exclude_none=True),
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"],  # as llm-compressor's MoE recipes
    }


# ---- GGUF (llama.cpp's files) ----------------------------------------------------------------
# llama.cpp's Q4_K_M recipe, as its quantizer applies it: Q4_K throughout but for attn_v
# and ffn_down in the first and last eighth of the layers and every third between (Q6_K),
# and the output head (Q6_K).
Q4_K_M = "Q4_K_M"


def write_gguf(model_dir: Path, out_file: Path, linear_type: str) -> None:
    """``model_dir`` (a Llama, one safetensors file) as a GGUF file, as llama.cpp's converter
    writes it: its config as ``llama.*`` metadata, q_proj and k_proj rows permuted, the
    decoder's projections quantized to ``linear_type`` (a block type the ``gguf``
    package quantizes: ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``Q8_0``, ``TQ2_0``; ``F16``; a k-quant type,
    ``Q4_K``, ``Q5_K`` or ``Q6_K``, packed here since the package does not quantize
    them; or ``Q4_K_M``, the mix above, with the embeddings in Q4_K), the output head
    as llama.cpp's quantizer types it (``_head_type``), every other tensor float32; the
    tokenizer (a byte-level BPE, the tiny models') as llama.cpp's ``gpt2`` vocabulary:
    its tokens, types and merges. K-quant rows take 256 inputs a block."""
    import gguf

    from radixserve.checkpoints.gguf import gguf_name, llama_cpp_permute

    config = json.loads((model_dir / "config.json").read_text())
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
        kind = _gguf_type(name, linear_type, config["num_hidden_layers"], weight.shape[-1])
        if kind is None:
            writer.add_tensor(gguf_name(name), weight.numpy())
        elif kind == "F16":
            writer.add_tensor(gguf_name(name), weight.half().numpy())
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name(name), quantize_gguf(weight, kind), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_type(name: str, linear_type: str, layers: int, inputs: int) -> str | None:
    """The GGUF type ``write_gguf`` gives tensor ``name`` of ``inputs`` columns (None: float32)."""
    module = name.removesuffix(".weight")
    projection = module.rsplit(".", 1)[-1] in PROJECTIONS and name.endswith(".weight")
    if module == "lm_head":
        return _head_type(linear_type, inputs)
    if linear_type != Q4_K_M:
        return linear_type if projection else None
    if module == "model.embed_tokens":
        return "Q4_K"
    if not projection:
        return None
    layer = int(module.split(".")[2])
    more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    if module.endswith(("v_proj", "down_proj")) and more_bits:
        return "Q6_K"
    return "Q4_K"


def _head_type(linear_type: str, inputs: int) -> str:
    """The output head's type as llama.cpp's quantizer chooses it: ``Q6_K`` whatever the
    file's type but ``Q8_0`` (kept) or a float one, and ``Q8_0`` where the rows are not
    whole 256-input k-quant blocks."""
    if linear_type in ("F16", "Q8_0"):
        return linear_type
    return "Q6_K" if inputs % 256 == 0 else "Q8_0"


def quantize_gguf(weight: torch.Tensor, kind: str) -> Any:
    """``weight`` ``[out, in]`` as GGUF blocks of ``kind`` (``[out, bytes a row]`` uint8):
    by the ``gguf`` package where it quantizes the type, by ``_k_quant`` for the k-quants."""
    import gguf
    import numpy as np

    if kind in _K_QUANTS:
        return _k_quant(weight.float().numpy().astype(np.float32), kind)
    return gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType[kind])


_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _k_quant(weight: Any, kind: str) -> Any:
    """Round-to-nearest k-quant blocks of 256 (ggml-common.h's ``block_q4_K``,
    ``block_q5_K``, ``block_q6_K``): sub-block scales (and, for Q4_K/Q5_K, minima) of 6
    bits (int8 for Q6_K) under a float16 super-scale. Not llama.cpp's search for the
    best scales: its layout, which is what a reader must get right."""
    import numpy as np

    out, inputs = weight.shape
    blocks = weight.reshape(-1, 256)
    n = blocks.shape[0]
    if kind == "Q6_K":
        sub = blocks.reshape(n, 16, 16)
        wanted = np.abs(sub).max(-1) / 31  # each sub-block's scale: q - 32 in [-32, 31]
        d = (wanted.max(-1) / 127).astype(np.float16)
        sc = np.clip(np.round(wanted / np.maximum(d.astype(np.float32), 1e-30)[:, None]), -128, 127).astype(np.int8)
        step = d.astype(np.float32)[:, None] * sc.astype(np.float32)
        q = np.clip(np.round(sub / np.where(step == 0, 1, step)[..., None]), -32, 31).astype(np.int16) + 32
        q = q.reshape(n, 2, 4, 32).astype(np.uint8)  # per 128 values: four runs of 32
        ql = (q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)  # [n, 2, 2, 32]: runs 0/1 low, 2/3 high
        qh = sum((q[:, :, k] >> 4) << (2 * k) for k in range(4)).astype(np.uint8)  # [n, 2, 32]
        parts = [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)]
        return np.concatenate(parts, axis=-1).reshape(out, -1)
    bits = 4 if kind == "Q4_K" else 5
    top = 2**bits - 1
    sub = blocks.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    wanted_scale, wanted_min = (sub.max(-1) - low) / top, -low
    d = (wanted_scale.max(-1) / 63).astype(np.float16)
    dmin = (wanted_min.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(wanted_scale / np.maximum(d.astype(np.float32), 1e-30)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(wanted_min / np.maximum(dmin.astype(np.float32), 1e-30)[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((sub + offset[..., None]) / np.where(step == 0, 1, step)[..., None]), 0, top).astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
            (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )
    pairs = q.reshape(n, 4, 2, 32)  # sub-blocks 2i and 2i + 1 share 32 bytes: low and high nibbles
    qs = ((pairs[:, :, 0] & 0x0F) | ((pairs[:, :, 1] & 0x0F) << 4)).reshape(n, 128)
    head = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), scales]
    if bits == 5:  # bit j of byte l: sub-block j's value l, its fifth bit
        high = (q.reshape(n, 8, 32) >> 4).astype(np.uint8)
        head.append(sum(high[:, j] << j for j in range(8)).astype(np.uint8))
    return np.concatenate([*head, qs], axis=-1).reshape(out, -1)


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
