"""HF model directory -> constructed model with its safetensors weights loaded.

Typical use (what the model runner does)::

    config = load_config(path)
    dtype = resolve_dtype(args.dtype, config, platform)
    query = model_kernel_query(config, platform.name, dtype, tp_size=..., page_size=...)
    ctx = ModelContext.create(registry, query, device, quantization=args.quantization, ...)
    model, config = load_model(path, ctx, registry, config=config)
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from radixserve.checkpoints.embedding import causal_lm_of
from radixserve.checkpoints.gguf import is_materialized, iterate_gguf_weights
from radixserve.checkpoints.lora import max_rank_for
from radixserve.checkpoints.quantized import resolve_quantization
from radixserve.checkpoints.source import safetensors_files
from radixserve.kernels import KernelQuery
from radixserve.layers.context import ModelContext
from radixserve.layers.embedding import ParallelLMHead
from radixserve.layers.linear import linear_layers
from radixserve.layers.pooler import HiddenStatesHead
from radixserve.layers.weights import CheckpointTensor
from radixserve.platform import DtypeChoice, Platform

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.backend_timing import ModelShapes
    from radixserve.models import ModelFacts
    from radixserve.models.base import CausalLM

logger = logging.getLogger(__name__)

DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def load_config(model_path: str | Path) -> PretrainedConfig:
    from transformers import AutoConfig

    config: PretrainedConfig = AutoConfig.from_pretrained(str(model_path))
    return config


def import_config_class(model_path: str | Path) -> None:
    """Import the configuration class of the model at ``model_path`` (by its
    config.json's ``model_type``), reading nothing else. A rank held while the
    server checks does this meanwhile: the plan it is then handed carries the
    config, and unpickling it would import the class (with transformers'
    integrations behind it: a third of a second of CPU) on the start-up's
    critical path. A model type transformers does not know is left to the
    plan's own load, which says what is wrong."""
    import json

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        model_type = json.loads((Path(model_path) / "config.json").read_text())["model_type"]
        CONFIG_MAPPING[model_type]
    except (OSError, ValueError, KeyError, TypeError):  # a hub id not downloaded yet, or an unknown type
        return


def _as_dtype(value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {value!r}; known: {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


def checkpoint_dtype(config: PretrainedConfig) -> torch.dtype | None:
    """The dtype the checkpoint was saved in, per its config (None if unstated)."""
    return _as_dtype(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))


def choose_dtype(
    requested: str | torch.dtype, config: PretrainedConfig, platform: Platform | type[Platform]
) -> DtypeChoice:
    """The compute dtype for ``--dtype requested`` on ``platform`` (a Platform class
    or instance), and why. ``auto`` asks the platform (``Platform.auto_dtype``) for
    the checkpoint's dtype: by default a 16-bit checkpoint keeps its dtype where the
    platform supports it and anything else (float32 or unstated) takes the
    platform's default, the same rule as HF-serving engines (fp32 checkpoints run
    in bf16 on accelerators); the CPU platform decides by the CPU's bfloat16 support.
    """
    if requested == "auto":
        return platform.auto_dtype(checkpoint_dtype(config))
    dtype = _as_dtype(requested)
    if dtype is None or dtype not in platform.supported_dtypes:
        raise ValueError(f"dtype {dtype} is not supported by platform {platform.name!r}: {platform.supported_dtypes}")
    return DtypeChoice(dtype, f"--dtype {str(dtype).removeprefix('torch.')}")


def resolve_dtype(requested: str | torch.dtype, config: PretrainedConfig, platform: Any) -> torch.dtype:
    """The dtype of :func:`choose_dtype`."""
    return choose_dtype(requested, config, platform).dtype


def model_kernel_query(
    config: PretrainedConfig,
    device: str,
    dtype: torch.dtype,
    *,
    tp_size: int = 1,
    page_size: int = 1,
    kv_dtype: torch.dtype | None = None,
    quantization: str | None = None,
    registry: Any = None,
) -> KernelQuery:
    """The backend-selection query for one TP rank of the model in ``config``,
    from the facts its model class (looked up in ``registry``, by default the
    process's) states. A checkpoint that ships quantized names its own method
    (``checkpoints.quantized``): ``quantization`` may only repeat it."""
    facts = model_facts(config, registry)
    quantization, quantized_checkpoint = resolve_quantization(config, quantization)
    saved = checkpoint_dtype(config)
    narrower = saved in (torch.bfloat16, torch.float16) and dtype == torch.float32
    return KernelQuery(
        device=device,
        dtype=dtype,
        head_dim=facts.head_dim,
        num_heads=facts.num_heads // tp_size,
        num_kv_heads=max(1, facts.num_kv_heads // tp_size),
        page_size=page_size,
        kv_dtype=kv_dtype or dtype,
        num_experts=facts.num_experts or None,
        top_k=facts.top_k or None,
        quantization=quantization,
        quantized_checkpoint=quantized_checkpoint,
        sliding_window=facts.sliding_window,
        logit_softcap=facts.logit_softcap,
        elementwise_ops=facts.elementwise_ops or None,
        mla=facts.mla,
        weight_dtype=saved if narrower else None,
    )


def model_facts(config: PretrainedConfig, registry: Any = None) -> ModelFacts:
    """What the registered class of ``config.architectures[0]`` says of the model."""
    from radixserve.registry import get_registry

    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ValueError("config.json names no architectures")
    return model_class(registry or get_registry(), architectures[0]).model_facts(config)


def check_tp_shapes(config: PretrainedConfig, tp_size: int) -> None:
    """ValueError naming ``tp_size``, the config field that ``tp_size`` ranks
    cannot split, and the sizes that can (:func:`tp_sizes_that_split`)."""
    problem = _tp_shape_problem(config, tp_size)
    if problem:
        sizes = ", ".join(map(str, tp_sizes_that_split(config)))
        raise ValueError(f"tp_size: {tp_size} ranks {problem}; this model splits over {sizes} ranks")


def tp_sizes_that_split(config: PretrainedConfig) -> list[int]:
    """The tensor-parallel sizes (up to the attention heads) that split ``config``."""
    return [n for n in range(1, config.num_attention_heads + 1) if not _tp_shape_problem(config, n)]


def _tp_shape_problem(config: PretrainedConfig, tp_size: int) -> str:
    """What ``tp_size`` ranks cannot split (empty: nothing): attention heads, the
    MLP's and the experts' intermediate sizes must divide evenly; KV heads divide,
    or are replicated when fewer than the ranks (then the ranks must be a multiple
    of them). The vocabulary is padded."""
    fields = {
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": getattr(config, "intermediate_size", None),
        "moe_intermediate_size": getattr(config, "moe_intermediate_size", None),
        "shared_expert_intermediate_size": getattr(config, "shared_expert_intermediate_size", None),
    }
    for name, value in fields.items():
        if value and value % tp_size:
            return f"cannot split {name} {value} (it must divide it)"
    kv_heads = config.num_key_value_heads
    if kv_heads % tp_size and tp_size % kv_heads:
        return (
            f"cannot share num_key_value_heads {kv_heads} (one must divide the other: "
            "fewer KV heads than ranks are replicated)"
        )
    return ""


def model_query_for_args(
    args: Any, config: PretrainedConfig, platform: Any, dtype: torch.dtype | None = None
) -> KernelQuery:
    """The query for ``args`` (a ServerArgs: dtype, KV cache dtype, TP size, page
    size, quantization) on ``platform``; what the start-up checks ask the registry.
    ``dtype``: the compute dtype already chosen (by tensor-parallel rank 0), else
    ``--dtype`` resolved here."""
    dtype = dtype or resolve_dtype(args.dtype, config, platform)
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else DTYPE_NAMES[args.kv_cache_dtype]
    query = model_kernel_query(
        config,
        platform.name,
        dtype,
        tp_size=args.tp_size,
        page_size=args.page_size,
        kv_dtype=kv_dtype,
        quantization=args.quantization,
    )
    if not args.enable_lora:
        return query
    return replace(query, max_lora_rank=max_rank_for(args.max_lora_rank, args.lora_adapters()))


def model_timing_shapes(
    config: PretrainedConfig,
    query: KernelQuery,
    *,
    tp_size: int,
    decode_rows: int,
    prefill_rows: int,
    context_length: int,
) -> ModelShapes:
    """One rank's shapes of the model in ``config``, for timing backends on them
    (radixserve/backend_timing.py): ``decode_rows`` requests of ``context_length``
    tokens (capped at 1024) per decode step, ``prefill_rows`` tokens per prefill chunk."""
    from radixserve.backend_timing import ModelShapes

    facts = model_facts(config)
    assert query.num_heads is not None and query.num_kv_heads is not None and query.head_dim is not None
    return ModelShapes(
        hidden_size=config.hidden_size,
        intermediate_size=facts.dense_intermediate_size // tp_size,
        num_heads=query.num_heads,
        num_kv_heads=query.num_kv_heads,
        head_dim=query.head_dim,
        vocab_size=config.vocab_size,
        decode_rows=decode_rows,
        prefill_rows=prefill_rows,
        decode_context=min(context_length, 1024),
        num_experts=query.num_experts or 0,
        top_k=query.top_k or 0,
        moe_intermediate_size=facts.moe_intermediate_size // tp_size,
        num_layers=config.num_hidden_layers,
    )


def eos_token_ids(model_path: str | Path, config: PretrainedConfig, tokenizer: Any) -> set[int]:
    """EOS ids from the model config, its generation config (e.g. Llama 3's
    <|eot_id|>) and the tokenizer."""
    from transformers import GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # the file is optional
        generation_config = None
    ids: set[int] = set()
    for source in (getattr(s, "eos_token_id", None) for s in (config, generation_config, tokenizer)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids


def iterate_weights(model_path: str | Path) -> Iterator[tuple[str, CheckpointTensor | torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the checkpoint, not read yet (a
    ``CheckpointTensor``: the weight loaders read only the rows or columns their
    rank holds), one file open at a time, with a progress bar over the files on
    stderr when it is a terminal."""
    from safetensors import safe_open
    from tqdm import tqdm

    if not hasattr(tqdm, "_lock"):
        # tqdm's default lock includes a multiprocessing semaphore, which the
        # resource tracker reports as leaked when the scheduler is stopped.
        tqdm.set_lock(threading.RLock())
    if is_materialized(model_path):  # a GGUF file (checkpoints/gguf.py)
        yield from iterate_gguf_weights(model_path)
        return
    files = safetensors_files(model_path)
    for path in tqdm(files, desc="Loading weights", unit="file", file=sys.stderr, disable=not sys.stderr.isatty()):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                source = f.get_slice(name)
                yield name, CheckpointTensor(source, tuple(source.get_shape()))


def model_class(registry: Any, architecture: str) -> type[CausalLM]:
    """The registered class for ``architecture``; a backbone without an LM head
    (``Qwen3Model``) is served by its family's class (``Qwen3ForCausalLM``), for embeddings."""
    causal_lm = causal_lm_of(architecture)
    known = registry.candidates["model"]
    if causal_lm is not None and architecture not in known and causal_lm in known:
        architecture = causal_lm
    return cast("type[CausalLM]", registry.model_class(architecture))


def load_model(
    model_path: str | Path,
    ctx: ModelContext,
    registry: Any,
    *,
    config: PretrainedConfig | None = None,
    embedding: bool = False,
) -> tuple[nn.Module, PretrainedConfig]:
    """Build the registered class for ``config.architectures[0]`` on ``ctx.device``
    in ``ctx.dtype``, load the safetensors weights (cast to ``ctx.dtype``), let the
    quantization method post-process every linear layer (and the GEMM backend
    prepare an untied LM head's weight), and return it in eval mode. ``embedding``:
    serve it for embeddings (``replace_lm_heads``)."""
    config = config if config is not None else load_config(model_path)
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"{model_path}: config.json names no architectures")
    cls = model_class(registry, architectures[0])
    start = time.perf_counter()
    with torch.device(ctx.device):
        model = cast(nn.Module, cls(config, ctx))  # every model class is a module
    weights: Iterator[tuple[str, Any]] = iterate_weights(model_path)
    if embedding:
        # HF's name for the backbone, ``model`` in every family served; a class may say otherwise.
        weights = backbone_weights(weights, replace_lm_heads(model), getattr(model, "base_model_prefix", "model"))
    cast("CausalLM", model).load_weights(weights)
    for layer in linear_layers(model):
        layer.quant.process_weights_after_loading(layer)
    for head in (m for m in model.modules() if isinstance(m, ParallelLMHead)):
        head.process_weights_after_loading()
    logger.info(
        "loaded %s (%s) from %s in %s on %s in %.2f s%s",
        architectures[0],
        cls.__name__,
        model_path,
        ctx.dtype,
        ctx.device,
        time.perf_counter() - start,
        ", for embeddings" if embedding else "",
    )
    return model.eval(), config


def replace_lm_heads(model: nn.Module) -> list[str]:
    """Serve ``model`` for embeddings: each of its LM heads becomes a
    ``HiddenStatesHead``, so its forward returns the final hidden states
    (layers/pooler.py). Returns the heads' names."""
    heads = [name for name, module in model.named_modules() if isinstance(module, ParallelLMHead)]
    if not heads:
        raise ValueError(f"{type(model).__name__} has no ParallelLMHead, so it cannot be served for embeddings")
    for name in heads:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, HiddenStatesHead())
    return heads


def backbone_weights(weights: Iterator[tuple[str, Any]], heads: list[str], prefix: str) -> Iterator[tuple[str, Any]]:
    """``weights`` without the tensors of the LM ``heads``, and with the backbone's
    name ``prefix`` put before the names of a backbone checkpoint (``Qwen3Model``'s
    ``layers.0...`` are ``model.layers.0...`` in the family's class)."""
    for name, tensor in weights:
        if not any(name.startswith(head + ".") for head in heads):
            yield (name if name.startswith(prefix + ".") else f"{prefix}.{name}"), tensor
