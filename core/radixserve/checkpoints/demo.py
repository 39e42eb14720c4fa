"""The built-in demo model, served when no ``--model`` is given: a small
Llama-architecture model with random weights and a byte-level BPE tokenizer
(ChatML template), built offline and deterministically on first use.

It exists so that ``radixserve serve`` works on a fresh machine without a
download; its output is gibberish. It is cached under the user cache directory
(``RADIXSERVE_CACHE_DIR`` overrides); concurrent first runs each build into a
temporary directory and the first atomic rename wins.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TypedDict

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "radixserve-demo"
# Bump when the recipe changes, so stale caches are not reused.
_VERSION = "v2"


class _Recipe(TypedDict):
    """``build_llama_without_its_class``'s arguments for the demo model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    seed: int


_RECIPE = _Recipe(
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=688,
    vocab_size=2048,
    max_position_embeddings=2048,
    seed=0,
)


def cache_dir() -> Path:
    override = os.environ.get("RADIXSERVE_CACHE_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("radixserve"))


def demo_model_dir() -> Path:
    """Where the demo model is (or will be, once ``demo_model_path`` built it)."""
    return cache_dir() / f"demo-model-{_VERSION}"


def demo_model_built() -> bool:
    """Whether the demo model is cached (``demo_model_path`` returns at once)."""
    return demo_model_dir().is_dir()


def demo_model_path() -> Path:
    """The demo model's directory, built first if it is not cached yet."""
    final = demo_model_dir()
    if final.is_dir():
        return final
    from radixserve.checkpoints.random_model import build_llama_without_its_class

    final.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the demo model (random weights) into %s", final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build_llama_without_its_class(tmp, **_RECIPE)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
