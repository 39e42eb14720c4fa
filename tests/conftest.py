"""Shared fixtures: tiny on-the-fly models (see radixserve.testing.tiny_models)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from radixserve.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``build(**build_tiny_model_kwargs) -> model dir``, built once per session
    for each distinct set of arguments."""
    built: dict[str, Path] = {}

    def build(**kwargs: Any) -> Path:
        key = repr(sorted(kwargs.items()))
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp(kwargs.get("arch", "llama")), **kwargs)
        return built[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """The default tiny Llama with its tokenizer."""
    return tiny_model_factory(arch="llama")


# -- the CPU kernels (plugins/radixserve_torch/cpu_kernels.py) ----------------


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built() -> None:
    """Build (first run on a machine) or load the CPU kernels once, before any test
    starts a server or scheduler that would pick them (they are the cpu defaults)."""
    from radixserve_torch import cpu_kernels

    if not cpu_kernels.missing_tools():
        cpu_kernels.load()
