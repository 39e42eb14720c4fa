"""EAGLE heads whose drafts a test can predict (test_speculative, test_tensor_parallel):
each reads the target's next-token choice off its features, so it proposes the
request's newest token again, which the tiny models' looping outputs sometimes
keep (both verdicts happen)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from radixserve.checkpoints.random_eagle import build_random_eagle3_head, build_random_eagle_head


def copying_eagle_head(target_dir: Path, out_dir: Path) -> Path:
    """An EAGLE-1/2 head whose ``fc`` passes the feature through and whose layer only
    perturbs it; it ships an ``embed_tokens`` copy, as some checkpoints do (the head
    uses the target's)."""
    out = build_random_eagle_head(target_dir, out_dir, seed=3)
    weights = load_file(out / "model.safetensors")
    hidden = weights["fc.bias"].shape[0]
    weights = {k: v * 0.2 if k.startswith("layers.") and "norm" not in k else v for k, v in weights.items()}
    weights["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    weights["embed_tokens.weight"] = torch.zeros(512, hidden)
    save_file(weights, out / "model.safetensors")
    return out


def copying_eagle3_head(target_dir: Path, out_dir: Path, draft_vocab_size: int = 256) -> Path:
    """An EAGLE-3 head reading the target's first, middle and last layers, whose ``fc``
    passes the last one through (its layer only perturbs it) and whose final norm and
    LM head are the target's own over a random half of the vocabulary (a newest token
    outside it is proposed as something else)."""
    num_layers = json.loads((target_dir / "config.json").read_text())["num_hidden_layers"]
    layer_ids = [0, num_layers // 2, num_layers - 1]
    out = build_random_eagle3_head(target_dir, out_dir, draft_vocab_size, layer_ids, seed=5)
    weights = load_file(out / "model.safetensors")
    target = load_file(target_dir / "model.safetensors")
    hidden = weights["norm.weight"].shape[0]
    weights = {k: v * 0.2 if k.startswith("midlayer.") and "norm" not in k else v for k, v in weights.items()}
    weights["fc.weight"] = torch.cat([torch.zeros(hidden, 2 * hidden), torch.eye(hidden)], dim=1)
    draft_tokens = weights["d2t"] + torch.arange(draft_vocab_size)
    weights["lm_head.weight"] = target["lm_head.weight"][draft_tokens].clone()
    weights["norm.weight"] = target["model.norm.weight"].clone()
    weights["embed_tokens.weight"] = torch.zeros(512, hidden)
    save_file(weights, out / "model.safetensors")
    return out
