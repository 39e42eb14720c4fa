"""Plugins (ours, hardware distributions, the third-party templates) import only
the core's public API, so they are written exactly as an outside author's. A
model plugin builds on the model classes and layers (docs/models.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = (
    "radixserve.hooks",
    "radixserve.kernels",
    "radixserve.platform",
    "radixserve.forward_batch",
    "radixserve.cache.memory_pool",
    "radixserve.communicator",
    "radixserve.testing",
    "radixserve.disaggregation.tcp_transfer",  # the control plane a one-sided KV-transfer backend keeps
    "radixserve.models",
    "radixserve.layers",
)
PLUGIN_DIRS = ("plugins", "hardware", "examples")


def core_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found += [(node.lineno, n) for n in names if n == "radixserve" or n.startswith("radixserve.")]
    return found


# The sources, not the copies a pip install leaves in a plugin's build/ (ignored by git; a
# test that installs the example plugin makes them, so the files checked would depend on the runs before).
FILES = sorted(p for d in PLUGIN_DIRS for p in (ROOT / d).rglob("*.py") if "build" not in p.relative_to(ROOT / d).parts)


def test_there_are_plugin_files():
    assert len(FILES) > 10


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plugin_imports_only_public_api(path):
    private = [
        (line, name)
        for line, name in core_imports(path)
        if not any(name == p or name.startswith(p + ".") for p in PUBLIC)
    ]
    assert not private, f"{path.relative_to(ROOT)} imports non-public core modules: {private}"
