"""GGUF files (llama.cpp's) as a model path: ``--model m.gguf`` (``--tokenizer-path DIR``
for an HF tokenizer, else the file's own, which transformers reads).

The file is read in place; what the rest of radixserve reads from a model directory
is written once into a small directory beside the user cache (``materialize``): the
HF config transformers derives from the file's metadata (plus a
``quantization_config`` naming the projections' GGUF type), the tokenizer, and
``gguf.json`` pointing at the file. ``iterate_gguf_weights`` then gives its tensors
under HF names: the projections in ``Q4_0`` or ``Q8_0`` as they are quantized
(``qweight``, one integer a byte, ``qzeros`` and ``scales``, out-major, groups of 32:
the ``gguf`` quantization method loads them), every other tensor dequantized to
float32; q_proj and k_proj rows back in HF's order (llama.cpp's converter permutes
them for its rotary). Served: Llama-family files whose projections are all of one of
those two types. Needs the ``gguf`` package (``pip install gguf``)."""

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
SERVED_LINEAR_TYPES = ("Q4_0", "Q8_0")
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
_BLOCK = 32  # values a Q4_0 or Q8_0 block


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


def linear_type(reader: Any) -> str:
    """The GGUF type of every projection; ValueError unless it is one served type."""
    types = {t.tensor_type.name for t in reader.tensors if t.name.rsplit(".", 2)[-2] in PROJECTIONS}
    if len(types) != 1 or not types <= set(SERVED_LINEAR_TYPES):
        raise ValueError(
            f"model_path: the GGUF file's projections are {', '.join(sorted(types)) or 'missing'}; "
            f"served: all of one type of {', '.join(SERVED_LINEAR_TYPES)}"
        )
    return str(types.pop())


def materialize(gguf_file: str, tokenizer_path: str | None, cache_root: Path) -> Path:
    """The model directory standing for ``gguf_file`` (written on first use, kept under
    ``cache_root/gguf``): config.json, the tokenizer and ``gguf.json``."""
    from transformers import AutoConfig, AutoTokenizer

    source = Path(gguf_file).resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{tokenizer_path}".encode()).hexdigest()[:16]
    target = cache_root / "gguf" / f"{source.stem}-{key}"
    if (target / GGUF_INFO).is_file():
        return target
    reader = _reader(source)
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"model_path: GGUF architecture {architecture!r} is not served; served: {', '.join(ARCHITECTURES)}"
        )
    quantized = linear_type(reader)
    building = target.with_name(target.name + f".building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name).to_dict()
    config["architectures"] = [ARCHITECTURES[architecture]]
    config["quantization_config"] = {"quant_method": "gguf", "linear_type": quantized}
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
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in _reader(info["file"]).tensors:
        name, kind = hf_name(tensor.name), tensor.name.rsplit(".", 2)[-2]
        permuted = heads.get(kind) if name.endswith(".weight") else None
        if kind in PROJECTIONS and name.endswith(".weight"):
            module = name.removesuffix(".weight")
            parts = {f"{module}.{part}": value for part, value in _blocks(tensor.data, tensor.tensor_type.name).items()}
        else:
            parts = {name: torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()).float()}
        for part_name, value in parts.items():
            yield part_name, value if permuted is None else hf_rows(value, permuted)


def _blocks(data: Any, kind: str) -> dict[str, torch.Tensor]:
    """A Q4_0 or Q8_0 matrix's rows of blocks as ``qweight`` (unsigned: 8 or 128 added),
    ``qzeros`` (that 8 or 128) and ``scales`` (each block's, float32): a weight is
    ``(qweight - qzeros) * scales`` over its block of 32 inputs."""
    import torch

    raw = torch.from_numpy(data.copy())  # [out, blocks * bytes a block], uint8
    out = raw.shape[0]
    if kind == "Q4_0":  # a block: float16 d, then 16 bytes: values j (low nibble) and j + 16 (high)
        blocks = raw.view(out, -1, 18)
        packed = blocks[..., 2:]
        qweight = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(out, -1)
        middle = 8
    else:  # Q8_0: float16 d, then 32 signed bytes
        blocks = raw.view(out, -1, 34)
        qweight = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8).reshape(out, -1)
        middle = 128
    scales = blocks[..., :2].contiguous().view(torch.float16).reshape(out, -1).float()
    return {"qweight": qweight, "qzeros": torch.full(scales.shape, middle, dtype=torch.uint8), "scales": scales}
