"""LoRA adapters for the tests, written offline over a tiny Llama (PEFT's layout),
and HF transformers + PEFT's greedy tokens under one as the reference."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from radixserve.checkpoints.random_adapter import build_random_adapter

# name -> build_random_adapter's arguments: ranks 8, 4 and 16, every target module or a
# few, a lora_alpha other than r, rsLoRA's scaling.
ADAPTERS = {
    "all8": dict(rank=8, seed=1),
    "qv4": dict(rank=4, alpha=16, target_modules=("q_proj", "v_proj"), seed=2),
    "mlp16": dict(rank=16, target_modules=("o_proj", "gate_proj", "down_proj"), seed=3, use_rslora=True),
    "kv8": dict(rank=8, target_modules=("k_proj", "v_proj", "up_proj"), seed=4, strength=2.0),
}


def build_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    return {name: build_random_adapter(model_dir, root / name, **kw) for name, kw in ADAPTERS.items()}


def lora_paths(adapters: dict[str, Path]) -> list[str]:
    return [f"{name}={path}" for name, path in adapters.items()]


def peft_greedy(model_dir: Path, adapter: Path | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy tokens (fp32), under PEFT's ``adapter`` (None: the base model)."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=model.config.vocab_size + 1,  # never: like ignore_eos
        pad_token_id=model.config.vocab_size + 1,
    )
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)), generation_config=config)
    return out[0, len(prompt) :].tolist()
