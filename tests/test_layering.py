"""Imports point one way. Every module under core/radixserve imports only
modules of its own layer or of the layers below it, and no modules import each
other in a cycle. The layers are read from docs/architecture.md ("Layers"), so
the document and this test cannot drift apart; a new module must be given a
layer there before this test passes.

Function-level (lazy) imports count for both checks: deferring an import saves
its cost until it is needed, it does not change which module depends on which.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"
PACKAGE = "radixserve"
DOC = ROOT / "docs" / "architecture.md"


def layer_table() -> list[list[str]]:
    """The doc's layers, lowest first, each a list of entries (``engine.py``,
    ``runtime/``, ``__init__.py`` for the package itself). The block lists the
    top layer first, one layer a line: names, then two or more spaces and what
    the layer is; a names column that ends with a comma goes on next line."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Layers")) + 1
    layers: list[list[str]] = []
    continued = False
    for line in lines[start:]:
        if not line.startswith("    "):
            if line.strip() and layers:
                break  # the block has ended
            continue
        names = re.split(r"\s{2,}", line.strip())[0]
        entries = [name.strip() for name in names.split(",") if name.strip()]
        if continued:
            layers[-1] += entries
        else:
            layers.append(entries)
        continued = names.endswith(",")
    return layers[::-1]


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted((CORE / PACKAGE).rglob("*.py")):
        parts = path.relative_to(CORE).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def entry_matches(entry: str, module: str) -> bool:
    if entry == "__init__.py":
        return module == PACKAGE
    if entry.endswith("/__init__.py"):
        return module == f"{PACKAGE}.{entry.removesuffix('/__init__.py').replace('/', '.')}"
    if entry.endswith("/"):
        package = f"{PACKAGE}.{entry[:-1].replace('/', '.')}"
        return module == package or module.startswith(package + ".")
    return module == f"{PACKAGE}.{entry.removesuffix('.py').replace('/', '.')}"


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports, at any depth in the file.
    ``from a import b`` names module ``a.b`` if there is one, else ``a``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import radixserve.x.y` of a name inside x
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def homes(module: str, layers: list[list[str]]) -> list[tuple[int, str]]:
    """The (layer, entry) pairs that hold ``module``: the entries naming it most
    specifically (a module's own entry wins over a folder entry that holds it)."""
    found = [(i, e) for i, entries in enumerate(layers) for e in entries if entry_matches(e, module)]
    best = max((_specificity(e) for _, e in found), default=0)
    return [(i, e) for i, e in found if _specificity(e) == best]


def _specificity(entry: str) -> int:
    return entry.count("/") * 2 + (0 if entry.endswith("/") else 1)


def layer_of() -> dict[str, int]:
    layers = layer_table()
    return {module: found[0][0] for module in module_files() if (found := homes(module, layers))}


def test_every_module_is_in_exactly_one_layer_and_every_entry_names_one() -> None:
    layers = layer_table()
    modules = module_files()
    assert len(layers) > 5, f"docs/architecture.md's Layers block did not parse: {layers}"
    placed = {m: homes(m, layers) for m in modules}
    assert {m: h for m, h in placed.items() if len(h) != 1} == {}, "modules without a layer, or with several"
    stale = [e for entries in layers for e in entries if not any(entry_matches(e, m) for m in modules)]
    assert stale == [], "layer entries that name no module"


def test_imports_point_down() -> None:
    layers, level = layer_table(), layer_of()
    upward = [
        f"{m} (layer {', '.join(layers[level[m]])}) imports {t} (layer {', '.join(layers[level[t]])})"
        for m, targets in sorted(graph().items())
        for t in sorted(targets)
        if level[t] > level[m]
    ]
    assert upward == [], "imports that point up:\n" + "\n".join(upward)


def test_nothing_outside_the_kit_imports_the_kit() -> None:
    """The plugin-author kit (``radixserve.testing``: the conformance kit, tiny
    models) is for tests: no module of the package outside it imports it, lazily
    or by name (``importlib.import_module``), so the serving path never loads it.
    What the serving path shares with the kit (the cases ``auto`` times) lives in
    ``radixserve.kernels.cases``."""
    kit = f"{PACKAGE}.testing"

    def in_kit(name: str) -> bool:
        return name == kit or name.startswith(kit + ".")

    modules = module_files()
    assert kit in modules, f"{kit} is gone: update this test"
    offenders = sorted(
        f"{m} imports {t}" for m, targets in graph().items() if not in_kit(m) for t in targets if in_kit(t)
    )
    offenders += [
        f"{m} imports {name} by name"
        for m, path in sorted(modules.items())
        if not in_kit(m)
        for name in _dynamic_imports(path)
        if in_kit(name)
    ]
    assert offenders == [], "modules outside the kit that import it:\n" + "\n".join(offenders)


def _dynamic_imports(path: Path) -> set[str]:
    """The string constants passed to ``import_module(...)`` or ``__import__(...)``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def test_core_imports_no_plugin() -> None:
    plugins = [
        f"{m} imports {t}"
        for m, path in module_files().items()
        for t in _top_level_imports(path)
        if t.startswith(f"{PACKAGE}_")
    ]
    assert plugins == [], "the core imports plugins:\n" + "\n".join(plugins)


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_import_cycles() -> None:
    edges = graph()
    state: dict[str, str] = {}  # "open" while on the DFS path, then "done"
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[module] = "done"
        return []

    for module in sorted(edges):
        if module not in state:
            cycle = visit(module)
            assert cycle == [], "import cycle: " + " -> ".join(cycle)
