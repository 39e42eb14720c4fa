"""Random EAGLE heads in EAGLE-1/2's checkpoint layout, written offline for a
Llama-family model directory: what the tests load (and check against HF's
decoder layer) and the benchmarks start from (benchmarks/train_speculative_models.py
trains one), nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from radixserve.checkpoints.random_adapter import module_shapes

HEAD_CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
    "hidden_act",
    "attention_bias",
)


def head_config(model_dir: str | Path, num_layers: int = 1) -> dict[str, Any]:
    """The head's config.json: the target's attention and MLP shapes, ``num_layers`` layers."""
    target = json.loads((Path(model_dir) / "config.json").read_text())
    config = {key: target[key] for key in HEAD_CONFIG_KEYS if key in target}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=num_layers)
    config.setdefault("torch_dtype", target.get("torch_dtype", "float32"))
    return config


def random_head_weights(config: dict[str, Any], seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """``fc`` and the layers' weights, normal with standard deviation ``scale``; the
    norms' weights near 1. The first layer has no input norm, as EAGLE trains it."""
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {"fc.weight": normal(hidden, 2 * hidden), "fc.bias": normal(hidden)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"layers.{i}"
        for name, (fan_in, fan_out) in module_shapes(config).items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            weights[f"{prefix}.{part}.{name}.weight"] = normal(fan_out, fan_in)
        norms = ["post_attention_layernorm"] + (["input_layernorm"] if i > 0 else [])
        for norm in norms:
            weights[f"{prefix}.{norm}.weight"] = 1 + normal(hidden)
    return weights


def build_random_eagle_head(model_dir: str | Path, out_dir: str | Path, num_layers: int = 1, seed: int = 0) -> Path:
    """Write a random EAGLE head for the model at ``model_dir`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = head_config(model_dir, num_layers)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in random_head_weights(config, seed).items()}, str(out / "model.safetensors"))
    return out
