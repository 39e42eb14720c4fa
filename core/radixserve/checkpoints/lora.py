"""LoRA adapters as PEFT saves them: ``adapter_config.json`` and
``adapter_model.safetensors`` in one directory.

Read to host memory, each adapter is its modules' A ``[r, in]`` and B ``[out, r]``
by the base model's module name (``model.layers.0.self_attn.q_proj``), with the
adapter's scaling (``lora_alpha / r``, or ``/ sqrt(r)`` for rsLoRA) folded into
B. What radixserve cannot serve (DoRA, trained biases, extra trained modules,
per-module ranks or alphas) is refused with the reason, never half-applied.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_MAX_LORA_RANK = 16
# The projections an adapter may target (PEFT's names for them).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterError(ValueError):
    """An adapter that cannot be served; ``field`` names the request field (or flag) at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


@dataclass(frozen=True)
class AdapterConfig:
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]  # PEFT's names (q_proj, ...), or full module names
    base_model: str | None

    @classmethod
    def read(cls, path: str, field: str = "lora_path") -> AdapterConfig:
        config_file = Path(path) / CONFIG_FILE
        if not config_file.is_file():
            raise AdapterError(field, f"{path!r} has no {CONFIG_FILE} (a PEFT LoRA adapter directory)")
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise AdapterError(field, f"{config_file} is not JSON: {exc}") from exc
        kind = config.get("peft_type", "LORA")
        if kind != "LORA":
            raise AdapterError(field, f"peft_type {kind!r}: only LORA adapters are served")
        refusals = {
            "use_dora": "DoRA adapters are not served",
            "modules_to_save": "adapters that train whole modules (modules_to_save) are not served",
            "rank_pattern": "per-module ranks (rank_pattern) are not served",
            "alpha_pattern": "per-module alphas (alpha_pattern) are not served",
        }
        for key, why in refusals.items():
            if config.get(key):
                raise AdapterError(field, why)
        if config.get("bias", "none") != "none":
            raise AdapterError(field, f"bias {config['bias']!r}: adapters that train biases are not served")
        rank = int(config.get("r", 8))
        alpha = float(config.get("lora_alpha", rank))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        targets = config.get("target_modules") or []
        if isinstance(targets, str):  # a regular expression: the weights file says which modules it has
            targets = []
        return cls(path, rank, scaling, tuple(sorted(targets)), config.get("base_model_name_or_path"))


@dataclass
class AdapterWeights:
    """An adapter in host memory: per base module, ``(A, B * scaling)``."""

    config: AdapterConfig
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def read(cls, path: str, dtype: torch.dtype, field: str = "lora_path") -> AdapterWeights:
        config = AdapterConfig.read(path, field)
        weights_file = Path(path) / WEIGHTS_FILE
        if not weights_file.is_file():
            raise AdapterError(field, f"{path!r} has no {WEIGHTS_FILE}")
        tensors = load_file(str(weights_file))
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, which = _module_of(key)
            if which is None:
                raise AdapterError(field, f"{WEIGHTS_FILE} holds {key!r}, which is no LoRA A or B matrix")
            pairs.setdefault(module, {})[which] = tensor
        modules = {}
        for module, pair in pairs.items():
            if set(pair) != {"lora_A", "lora_B"}:
                raise AdapterError(field, f"module {module!r} has {sorted(pair)} but needs both lora_A and lora_B")
            a, b = pair["lora_A"], pair["lora_B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise AdapterError(field, f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}")
            if a.shape[0] != config.rank:
                raise AdapterError(field, f"module {module!r} has rank {a.shape[0]}, the config says r={config.rank}")
            modules[module] = (a.to(dtype), (b.double() * config.scaling).to(dtype))
        if not modules:
            raise AdapterError(field, f"{WEIGHTS_FILE} holds no LoRA matrices")
        return cls(config, modules)


def _module_of(key: str) -> tuple[str, str | None]:
    """``base_model.model.X.lora_A.weight`` -> ``(X, "lora_A")``; ``(key, None)`` for other tensors."""
    name = key.removeprefix("base_model.model.")
    for which in ("lora_A", "lora_B"):
        for suffix in (f".{which}.weight", f".{which}.default.weight"):
            if name.endswith(suffix):
                return name[: -len(suffix)], which
    return key, None


def max_rank_for(max_lora_rank: int | None, adapters: dict[str, str]) -> int:
    """The slot width: ``--max-lora-rank``, else the largest rank of the adapters named at
    start, at least ``DEFAULT_MAX_LORA_RANK``; an adapter above a set limit is an error."""
    ranks = {name: AdapterConfig.read(path, "lora_paths").rank for name, path in adapters.items()}
    if max_lora_rank is None:
        return max([DEFAULT_MAX_LORA_RANK, *ranks.values()])
    for name, rank in ranks.items():
        if rank > max_lora_rank:
            raise AdapterError("lora_paths", f"adapter {name!r} has rank {rank}, above --max-lora-rank {max_lora_rank}")
    return max_lora_rank
