"""Random EAGLE heads in EAGLE-1/2's and EAGLE-3's checkpoint layouts, written
offline for a Llama-family model directory: what the tests load (and check
against HF's modules) and the benchmarks start from
(benchmarks/train_speculative_models.py trains them), nothing downloaded."""

from __future__ import annotations

import json
from collections.abc import Sequence
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


def eagle3_head_config(
    model_dir: str | Path, draft_vocab_size: int, layer_ids: Sequence[int] | None = None
) -> dict[str, Any]:
    """An EAGLE-3 head's config.json for the model at ``model_dir``: its draft
    vocabulary's size and, where given, the target layers it reads."""
    config = head_config(model_dir)
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab_size)
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    return config


def random_eagle3_weights(
    config: dict[str, Any], draft_tokens: Sequence[int], seed: int = 0, scale: float = 0.05
) -> dict[str, torch.Tensor]:
    """EAGLE-3's tensors, normal with standard deviation ``scale`` (norms near 1):
    ``fc`` over three features, the layer whose attention reads two rows side by side,
    the final norm, an LM head over ``draft_tokens`` (the target's ids of the draft
    vocabulary, in order) and ``d2t``/``t2d`` saying which they are."""
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {"fc.weight": normal(hidden, 3 * hidden)}
    for name, (fan_in, fan_out) in module_shapes(config).items():
        part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
        wide = 2 if name in ("q_proj", "k_proj", "v_proj") else 1
        weights[f"midlayer.{part}.{name}.weight"] = normal(fan_out, wide * fan_in)
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        weights[f"{norm}.weight"] = 1 + normal(hidden)
    weights.update(eagle3_token_map(draft_tokens, config["vocab_size"]))
    weights["lm_head.weight"] = normal(len(draft_tokens), hidden) * 10
    return weights


def eagle3_token_map(draft_tokens: Sequence[int], vocab_size: int) -> dict[str, torch.Tensor]:
    """EAGLE-3's ``d2t`` (target id minus draft id, per draft token) and ``t2d``
    (whether each target token is in the draft vocabulary)."""
    ids = torch.tensor(list(draft_tokens), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(len(ids)), "t2d": t2d}


def build_random_eagle3_head(
    model_dir: str | Path,
    out_dir: str | Path,
    draft_vocab_size: int,
    layer_ids: Sequence[int] | None = None,
    seed: int = 0,
) -> Path:
    """Write a random EAGLE-3 head for the model at ``model_dir`` into ``out_dir``;
    its draft vocabulary is ``draft_vocab_size`` of the target's tokens, drawn at random."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = eagle3_head_config(model_dir, draft_vocab_size, layer_ids)
    gen = torch.Generator().manual_seed(seed)
    draft_tokens = torch.randperm(config["vocab_size"], generator=gen)[:draft_vocab_size].sort().values.tolist()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = random_eagle3_weights(config, draft_tokens, seed)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out
