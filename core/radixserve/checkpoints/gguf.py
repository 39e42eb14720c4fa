"""GGUF files (llama.cpp's) as a model path: ``--model m.gguf`` (``--tokenizer-path DIR``
for an HF tokenizer, else the file's own, which transformers reads).

The file is read in place; what the rest of radixserve reads from a model directory
is written once into a small directory beside the user cache (``materialize``): the
HF config transformers derives from the file's metadata (plus a
``quantization_config`` naming the projections' GGUF types and the group size they
share), the tokenizer, and ``gguf.json`` pointing at the file. ``iterate_gguf_weights``
then gives its tensors under HF names: the projections as they are quantized
(``qweight``, one integer a byte, float ``qzeros`` and ``scales``, out-major: the
``gguf`` quantization method loads them), and the output head so too where its type is
one of them (llama.cpp's quantizer gives it ``Q6_K``, or ``Q8_0`` in a ``Q8_0`` file: a
third of a small model's bytes, which float32 would make 4-5x larger), every other
tensor dequantized to float32;
q_proj and k_proj rows back in HF's order (llama.cpp's converter permutes them for its
rotary).

Served: Llama-family files whose projections are of llama.cpp's block types
``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``Q8_0`` and k-quant types ``Q4_K``, ``Q5_K``,
``Q6_K``, mixed as the ``Q4_K_M``-style recipes mix them (one type a tensor), or all
float (``F32``, ``F16``, ``BF16``: served dense). Every type is read as integers ``q``
with a scale and a zero point per group of inputs, a weight being ``(q - zero) *
scale``: the types with a minimum (``Q4_1``, ``Q5_1``, ``Q4_K``, ``Q5_K``) have a
fractional zero point ``-min / scale``. A file mixing 16-input groups (``Q6_K``) with
32-input ones is read at 16 throughout (each 32-group's scale repeated), so that the
layers fusing tensors of several types share one layout; the quantization method
coarsens a layer back where its groups allow. Needs the ``gguf`` package
(``pip install gguf``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are made: the CLI opens a GGUF path before it loads torch
    import torch

GGUF_INFO = "gguf.json"  # in a materialized directory: which file it stands for
# GGUF type -> (bits of its integers, inputs a group): the projections' types served.
BLOCK_TYPES = {
    "Q4_0": (4, 32),
    "Q4_1": (4, 32),
    "Q5_0": (5, 32),
    "Q5_1": (5, 32),
    "Q8_0": (8, 32),
    "Q4_K": (4, 32),
    "Q5_K": (5, 32),
    "Q6_K": (6, 16),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
# llama.cpp's architecture -> the HF class of the config transformers derives.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
# HF's names of a layer's tensors -> llama.cpp's (blk.N.<name>), and the model's own.
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
MATERIALIZED_VERSION = 3  # part of a materialized directory's key: a new layout is written anew


def is_gguf_file(model_path: str) -> bool:
    return model_path.endswith(".gguf") and os.path.isfile(model_path)


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of an HF Llama tensor name (``...weight``)."""
    module, suffix = hf_name.rsplit(".", 1)
    if module in TOP_NAMES:
        return f"{TOP_NAMES[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{suffix}"


def hf_name(name: str) -> str:
    """The HF name of a llama.cpp tensor name; ValueError for one it does not know."""
    module, suffix = name.rsplit(".", 1)
    top = {gguf: hf for hf, gguf in TOP_NAMES.items()}
    if module in top:
        return f"{top[module]}.{suffix}"
    parts = module.split(".")
    layer = {gguf: hf for hf, gguf in LAYER_NAMES.items()}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r}: not a Llama tensor radixserve knows")


def llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter gives q_proj and k_proj (rotary halves interleaved)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def hf_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """``llama_cpp_permute`` undone."""
    return (
        weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _reader(path: str | Path) -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise ValueError(f"model_path: {path} is a GGUF file, which needs the gguf package: pip install gguf") from exc
    return gguf.GGUFReader(str(path))


def linear_types(reader: Any) -> list[str]:
    """The GGUF types of the projections; ValueError unless they are all block types
    served or all float."""
    types = sorted({t.tensor_type.name for t in reader.tensors if t.name.rsplit(".", 2)[-2] in PROJECTIONS})
    if types and (set(types) <= set(BLOCK_TYPES) or set(types) <= set(FLOAT_TYPES)):
        return types
    raise ValueError(
        f"model_path: the GGUF file's projections are {', '.join(types) or 'missing'}; served: any of "
        f"{', '.join(BLOCK_TYPES)}, or all float ({', '.join(FLOAT_TYPES)})"
    )


def head_type(reader: Any) -> str | None:
    """The GGUF type of the output head where it is a block type served (then loaded
    quantized); None where the file has no head of its own (tied to the embeddings) or
    stores it otherwise (dequantized at load, as the other tensors)."""
    kind = next((t.tensor_type.name for t in reader.tensors if t.name == "output.weight"), None)
    return kind if kind in BLOCK_TYPES else None


def quantization_config(types: list[str], lm_head_type: str | None = None) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` for projections of ``types`` and a head of
    ``lm_head_type`` (None: float). Float projections leave the whole model float: a
    quantized head among them is dequantized."""
    if set(types) <= set(FLOAT_TYPES):
        return None
    stored = [*types, lm_head_type] if lm_head_type is not None else types
    config: dict[str, Any] = {
        "quant_method": "gguf",
        "linear_types": types,
        "bits": max(BLOCK_TYPES[t][0] for t in stored),
        "group_size": min(BLOCK_TYPES[t][1] for t in stored),
    }
    if lm_head_type is not None:
        config["lm_head_type"] = lm_head_type
    return config


def materialize(gguf_file: str, tokenizer_path: str | None, cache_root: Path) -> Path:
    """The model directory standing for ``gguf_file`` (written on first use, kept under
    ``cache_root/gguf``): config.json, the tokenizer and ``gguf.json``."""
    from transformers import AutoConfig, AutoTokenizer

    source = Path(gguf_file).resolve()
    stat = source.stat()
    key = hashlib.sha256(
        f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{tokenizer_path}|{MATERIALIZED_VERSION}".encode()
    ).hexdigest()[:16]
    target = cache_root / "gguf" / f"{source.stem}-{key}"
    if (target / GGUF_INFO).is_file():
        return target
    reader = _reader(source)
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"model_path: GGUF architecture {architecture!r} is not served; served: {', '.join(ARCHITECTURES)}"
        )
    quantized = quantization_config(linear_types(reader), head_type(reader))
    building = target.with_name(target.name + f".building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name).to_dict()
    config["architectures"] = [ARCHITECTURES[architecture]]
    if quantized is not None:
        config["quantization_config"] = quantized
    (building / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_path is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        except Exception as exc:
            raise ValueError(
                f"model_path: the GGUF file's tokenizer cannot be read ({type(exc).__name__}: {exc}); "
                "give an HF tokenizer directory with --tokenizer-path"
            ) from exc
    tokenizer.save_pretrained(building)
    (building / GGUF_INFO).write_text(json.dumps({"file": str(source), "architecture": architecture}))
    if target.exists():  # another process materialized it meanwhile
        shutil.rmtree(building)
    else:
        building.replace(target)
    return target


def is_materialized(model_path: str | Path) -> bool:
    return (Path(model_path) / GGUF_INFO).is_file()


def iterate_gguf_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the file ``model_dir`` stands for, under HF names (module docstring)."""
    import gguf
    import torch

    info = json.loads((Path(model_dir) / GGUF_INFO).read_text())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    quantized = config.get("quantization_config") or {}
    group = quantized.get("group_size")
    blocks_read = set(PROJECTIONS) | ({"output"} if "lm_head_type" in quantized else set())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in _reader(info["file"]).tensors:
        name, kind = hf_name(tensor.name), tensor.name.rsplit(".", 2)[-2]
        permuted = heads.get(kind) if name.endswith(".weight") else None
        if group is not None and kind in blocks_read and name.endswith(".weight"):
            module = name.removesuffix(".weight")
            blocks = read_blocks(tensor.data, tensor.tensor_type.name, group)
            parts = {f"{module}.{part}": value for part, value in blocks.items()}
        else:
            parts = {name: torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()).float()}
        for part_name, value in parts.items():
            yield part_name, value if permuted is None else hf_rows(value, permuted)


def read_blocks(data: Any, kind: str, group: int) -> dict[str, torch.Tensor]:
    """A matrix of GGUF blocks of type ``kind`` (``[out, bytes a row]`` uint8) as
    ``qweight`` ``[out, in]`` (uint8), ``qzeros`` and ``scales`` ``[out, in / group]``
    (float32): each weight is ``(qweight - qzeros) * scales`` over its group of inputs.
    ``group`` divides the type's own group (whose figures are then repeated)."""
    import gguf
    import numpy as np
    import torch

    raw = np.ascontiguousarray(data).view(np.uint8)
    out = raw.shape[0]
    _, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    q, zeros, scales = _DECODERS[kind](raw.reshape(-1, block_bytes))
    own = BLOCK_TYPES[kind][1]
    if own % group:
        raise ValueError(f"GGUF {kind}: groups of {own} cannot be read as groups of {group}")
    q_t = torch.from_numpy(q.reshape(out, -1).copy())
    zeros_t, scales_t = (torch.from_numpy(v.reshape(out, -1).copy()).float() for v in (zeros, scales))
    repeat = own // group
    return {
        "qweight": q_t,
        "qzeros": zeros_t.repeat_interleave(repeat, dim=1),
        "scales": scales_t.repeat_interleave(repeat, dim=1),
    }


# ---- llama.cpp's block layouts (ggml-common.h), decoded to (q, zero, scale) ------------------------
# Each decoder takes blocks ``[n, bytes a block]`` (uint8) and returns q ``[n, values]``
# (uint8), zero points and scales ``[n, groups a block]`` (float32). A type with a
# minimum m (w = d * q + m) has the zero point -m / d. (A block's size in bytes is the
# gguf package's ``GGML_QUANT_SIZES``.)


def _f16(raw: Any) -> Any:
    import numpy as np

    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _with_minimum(q: Any, minimum: Any, scale: Any) -> tuple[Any, Any, Any]:
    """(q, zero, scale) of ``w = scale * q + minimum`` by group: the zero point is
    ``-minimum / scale``; a group whose scale is 0 holds its minimum alone, read as q 0,
    zero ``-minimum``, scale 1."""
    import numpy as np

    empty = scale == 0
    if empty.any():
        q = q.reshape(*scale.shape, -1).copy()
        q[empty] = 0
        q = q.reshape(scale.shape[0], -1)
        scale = np.where(empty, 1, scale).astype(np.float32)
    return q, (-minimum / scale).astype(np.float32), scale


def _nibbles(packed: Any) -> Any:
    """Bytes ``[n, 16]`` -> values ``[n, 32]``: value j in the low nibble of byte j, j + 16 in the high."""
    import numpy as np

    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _high_bits(qh: Any, count: int) -> Any:
    """Little-endian bit words ``[n, count / 8]`` bytes -> bits ``[n, count]`` (bit j of the word is value j's)."""
    import numpy as np

    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")[:, :count]


def _q4_0(b: Any) -> tuple[Any, Any, Any]:
    import numpy as np

    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]), np.full_like(d, 8), d


def _q4_1(b: Any) -> tuple[Any, Any, Any]:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _with_minimum(_nibbles(b[:, 4:]), m, d)


def _q5_0(b: Any) -> tuple[Any, Any, Any]:
    import numpy as np

    d = _f16(b[:, :2])
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6], 32) << 4)
    return q, np.full_like(d, 16), d


def _q5_1(b: Any) -> tuple[Any, Any, Any]:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8], 32) << 4)
    return _with_minimum(q, m, d)


def _q8_0(b: Any) -> tuple[Any, Any, Any]:
    import numpy as np

    d = _f16(b[:, :2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, np.full_like(d, 128), d


def _k_scales(packed: Any) -> tuple[Any, Any]:
    """Q4_K and Q5_K's 12 bytes of 6-bit scales and minima of 8 sub-blocks."""
    import numpy as np

    low, mins, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 6) << 4)], axis=-1)
    minima = np.concatenate([mins & 0x3F, (high >> 4) | ((mins >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), minima.astype(np.float32)


def _k_low_nibbles(qs: Any) -> Any:
    """Q4_K/Q5_K's 128 bytes: in each 32 bytes, sub-block 2i's low nibbles, then 2i+1's in the high ones."""
    import numpy as np

    chunks = qs.reshape(qs.shape[0], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(qs.shape[0], 256)


def _q4_k(b: Any) -> tuple[Any, Any, Any]:
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    scales = d * sc
    return _with_minimum(_k_low_nibbles(b[:, 16:]), -dmin * mn, scales)


def _q5_k(b: Any) -> tuple[Any, Any, Any]:
    import numpy as np

    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    scales = d * sc
    # qh: 32 bytes; sub-block j's high bits are bit j of each byte
    high = (b[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [n, 32 values, 8 sub-blocks]
    q = _k_low_nibbles(b[:, 48:]) | (high.transpose(0, 2, 1).reshape(b.shape[0], 256) << 4)
    return _with_minimum(q, -dmin * mn, scales)


def _q6_k(b: Any) -> tuple[Any, Any, Any]:
    import numpy as np

    n = b.shape[0]
    ql, qh = b[:, :128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
    low = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # per 128 values: four runs of 32
    high = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=2)  # [n, 2, 4, 32]
    q = (low | (high << 4)).reshape(n, 256)
    scales = b[:, 192:208].view(np.int8).astype(np.float32) * _f16(b[:, 208:210])
    return q, np.full_like(scales, 32), scales


_DECODERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
