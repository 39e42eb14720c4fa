"""Random LoRA adapters in PEFT's layout, written offline for a Llama-family model
directory: what the tests load (and check against PEFT itself) and the
benchmarks serve, nothing downloaded."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixserve.checkpoints.lora import CONFIG_FILE, LORA_TARGET_MODULES, WEIGHTS_FILE

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_shapes(config: dict[str, int]) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of each projection of a Llama-family decoder layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def build_random_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    rank: int = 8,
    alpha: float | None = None,
    target_modules: Sequence[str] = LORA_TARGET_MODULES,
    seed: int = 0,
    strength: float = 1.0,
    use_rslora: bool = False,
) -> Path:
    """Write a LoRA adapter for the model in ``model_dir`` to ``out_dir``: A and B drawn
    at random (B nonzero, unlike a fresh PEFT adapter's), scaled so that the update
    moves each projection's output by about ``strength`` times its base size."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = module_shapes(config)
    alpha = float(rank if alpha is None else alpha)
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in target_modules:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{_block(module)}.{module}"
            a = torch.randn((rank, fan_in), generator=gen) / math.sqrt(fan_in)
            b = torch.randn((fan_out, rank), generator=gen) * (strength / math.sqrt(rank) / scaling)
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2))
    return out


def _block(module: str) -> str:
    return "self_attn" if module in ATTENTION_MODULES else "mlp"
