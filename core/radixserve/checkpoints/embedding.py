"""Whether a model is served for embeddings, and how it pools.

A model is served for embeddings (``/v1/embeddings``; it generates nothing) when
``--is-embedding`` says so, or, unset, when it is one by its files: its
architecture is a backbone without an LM head (``Qwen3Model``, ``LlamaModel``:
HF's ``<Family>Model``, served by the family's ``<Family>ForCausalLM`` class
without its head), or its directory is a sentence-transformers model
(``modules.json`` with a Pooling module).

Pooling: ``--pooling`` and ``--normalize-embeddings`` when given; otherwise what
the sentence-transformers files say (``1_Pooling/config.json``'s
``pooling_mode_lasttoken`` or ``pooling_mode_mean_tokens``; a ``Normalize``
module), otherwise last-token pooling, normalised: the choice of the decoder
embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral), whose last token
attends to the whole input. A sentence-transformers module radixserve does not
apply (``Dense``, CLS or max pooling, ...) is an error rather than embeddings
that differ from the model's.

``dimensions`` (Matryoshka truncation) is served where the model's
``config.json`` marks it, as vLLM reads it: ``is_matryoshka: true`` (any size up
to the hidden size) or ``matryoshka_dimensions`` (those sizes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.config import PoolingMethod, ServerArgs

SENTENCE_TRANSFORMERS_MODULES = "modules.json"
# sentence-transformers' Pooling modes that radixserve computes.
_POOLING_MODES: dict[str, PoolingMethod] = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class EmbeddingConfig:
    """How an embedding model's requests are pooled, and what ``dimensions`` it takes."""

    pooling: PoolingMethod
    normalize: bool
    hidden_size: int
    matryoshka: bool = False  # trained for truncation (is_matryoshka or matryoshka_dimensions)
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes it was trained for; None: any
    source: str = "default"  # where pooling and normalize come from, for the log

    def dimensions_error(self, dimensions: int) -> str | None:
        """A message naming ``dimensions`` unless the model's embeddings may be cut to that size."""
        if not 1 <= dimensions <= self.hidden_size:
            return f"dimensions: must be in [1, {self.hidden_size}] (the model's embedding size), got {dimensions}"
        if dimensions == self.hidden_size:
            return None
        if not self.matryoshka:
            return (
                f"dimensions: the model is not marked as trained for Matryoshka truncation (is_matryoshka or "
                f"matryoshka_dimensions in its config.json), so only its full size {self.hidden_size} is served"
            )
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            return f"dimensions: must be one of {list(self.matryoshka_dimensions)}, got {dimensions}"
        return None


@dataclass(frozen=True)
class SentenceTransformersModules:
    """What a sentence-transformers directory says about pooling (None: no Pooling module)."""

    pooling: PoolingMethod | None
    normalize: bool


def causal_lm_of(architecture: str) -> str | None:
    """``Qwen3ForCausalLM`` for the backbone ``Qwen3Model`` (HF's naming), None for anything else."""
    if architecture.endswith("Model") and len(architecture) > len("Model"):
        return architecture[: -len("Model")] + "ForCausalLM"
    return None


def read_sentence_transformers(model_path: str | Path) -> SentenceTransformersModules | None:
    """The pooling of a sentence-transformers directory, None when it is not one. A
    ValueError names what radixserve would not compute as sentence-transformers does."""
    root = Path(model_path)
    path = root / SENTENCE_TRANSFORMERS_MODULES
    if not path.is_file():
        return None
    pooling: PoolingMethod | None = None
    normalize = False
    for module in json.loads(path.read_text()):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling = _pooling_mode(root / module.get("path", "") / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(
                f"{SENTENCE_TRANSFORMERS_MODULES}: the {kind} module ({module.get('path')}) is not applied by "
                "radixserve, so its embeddings would not be the model's"
            )
    return SentenceTransformersModules(pooling, normalize)


def _pooling_mode(path: Path) -> PoolingMethod:
    config: dict[str, Any] = json.loads(path.read_text())
    modes = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value is True)
    if len(modes) != 1 or modes[0] not in _POOLING_MODES:
        raise ValueError(
            f"{path.parent.name}/config.json: pooling {modes or 'none'} is not served (only "
            f"{' or '.join(_POOLING_MODES)}); --pooling last|mean overrides it"
        )
    if config.get("include_prompt", True) is not True:
        raise ValueError(f"{path.parent.name}/config.json: include_prompt false is not served")
    return _POOLING_MODES[modes[0]]


def embedding_config(args: ServerArgs, model_path: str | Path, hf_config: Any) -> EmbeddingConfig | None:
    """The model's embedding settings when it is served for embeddings, else None. A
    ValueError names the flag at odds with the model."""
    architecture = (getattr(hf_config, "architectures", None) or [""])[0]
    backbone = causal_lm_of(architecture) is not None
    if args.is_embedding is False:
        if backbone:
            raise ValueError(f"is_embedding: {architecture} has no LM head; it can only be served for embeddings")
        return None
    modules = read_sentence_transformers(model_path)
    if not (args.is_embedding or backbone or (modules is not None and modules.pooling is not None)):
        if args.pooling is not None or args.normalize_embeddings is not None:
            name = "pooling" if args.pooling is not None else "normalize_embeddings"
            raise ValueError(f"{name}: {architecture} is served for generation; pass --is-embedding to embed")
        return None
    pooling: PoolingMethod = "last"
    normalize, source = True, "default"
    if modules is not None:
        pooling, normalize, source = modules.pooling or pooling, modules.normalize, "sentence-transformers files"
    flags = [
        f
        for f, value in (("--pooling", args.pooling), ("--normalize-embeddings", args.normalize_embeddings))
        if value is not None
    ]
    if flags:
        source = " and ".join(flags) if len(flags) == 2 else f"{flags[0]}, {source}"
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return EmbeddingConfig(
        pooling=args.pooling or pooling,
        normalize=normalize if args.normalize_embeddings is None else args.normalize_embeddings,
        hidden_size=hf_config.hidden_size,
        matryoshka=bool(getattr(hf_config, "is_matryoshka", False)) or bool(dims),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        source=source,
    )
