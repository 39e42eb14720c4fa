"""examples/kernel-plugin as a real third-party distribution: pip-installed into
this environment, discovered through its entry point by `radixserve plugins`,
usable by name, conformant under the kit, generating the reference output
when selected by name, and gone again after uninstall.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kernel-plugin"
DIST = "radixserve-example-kernels"
PLUGIN = "example"

pytestmark = pytest.mark.skipif(not (EXAMPLE / "pyproject.toml").exists(), reason="examples/kernel-plugin is missing")


def _env() -> dict[str, str]:
    # No allow-list or interpreter opt-in from the outer environment.
    return {k: v for k, v in os.environ.items() if k not in ("RADIXSERVE_PLUGINS", "TRITON_INTERPRET")}


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _pip(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args], cwd)


def _plugins_json(cwd: Path) -> dict:
    # `radixserve plugins --json`, through the module so the test needs no PATH entry.
    proc = _run([sys.executable, "-m", "radixserve.cli", "plugins", "--json"], cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    # Build from a copy, so the source tree gets no build/ or *.egg-info, and run
    # the subprocesses outside the repository, so nothing there shadows site-packages.
    root = tmp_path_factory.mktemp("example-plugin")
    shutil.copytree(
        EXAMPLE,
        root / "kernel-plugin",
        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"),
    )
    return root


@pytest.fixture(scope="module")
def installed(workdir: Path):
    proc = _pip("install", "--no-deps", "--no-build-isolation", str(workdir / "kernel-plugin"), cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    try:
        yield workdir
    finally:
        if _installed():  # test_gone_after_uninstall has uninstalled it already, unless it failed first
            _pip("uninstall", "-y", DIST, cwd=workdir)


def _installed() -> bool:
    return any(True for _ in importlib.metadata.distributions(name=DIST))


def test_listed_and_usable_after_install(installed: Path):
    report = _plugins_json(installed)
    plugin = next((p for p in report["plugins"] if p["name"] == PLUGIN), None)
    assert plugin is not None, [p["name"] for p in report["plugins"]]
    assert plugin["distribution"] == DIST and plugin["version"] == "0.1.0"
    assert plugin["error"] is None
    assert plugin["registered"] == {"attention": ["example_sdpa"], "gemm": ["example_gemm"]}
    assert set(plugin["hooks"]) == {"register_attention_backends", "register_gemm_backends"}
    rows = {(kind, row["name"]): row for kind in ("attention", "gemm") for row in report["backends"][kind]}
    for key in (("attention", "example_sdpa"), ("gemm", "example_gemm")):
        assert rows[key]["usable"] and rows[key]["plugin"] == PLUGIN and rows[key]["priority"] == -10


def test_selected_by_name_not_by_auto(installed: Path):
    code = (
        "import torch\n"
        "from radixserve.registry import PluginRegistry\n"
        "from radixserve.kernels import KernelQuery\n"
        "r = PluginRegistry()\n"
        "q = KernelQuery(device='cpu', dtype=torch.float32, head_dim=64, num_heads=4, num_kv_heads=2)\n"
        "assert r.select('attention', q, 'example_sdpa').__module__ == 'radixserve_example_kernels.attention'\n"
        "assert r.select('gemm', q, 'example_gemm').name == 'example_gemm'\n"
        "assert r.select('attention', q).name != 'example_sdpa'\n"
        "print('ok')\n"
    )
    proc = _run([sys.executable, "-c", code], installed)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_its_own_tests_pass_the_conformance_kit(installed: Path):
    proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], installed / "kernel-plugin")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "passed" in proc.stdout.splitlines()[-1]


def test_generation_through_it_equals_reference(installed: Path, tiny_llama_dir: Path):
    from generation_utils import generate, make_scheduler, mixed_prompts

    from radixserve import Engine

    prompts = mixed_prompts(512, [7, 18], seed=41)
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    reference = generate(make_scheduler(tiny_llama_dir), prompts, **params)
    # The Engine's scheduler process is spawned after the install, so it finds
    # the plugin through its entry point like any user's process would.
    with Engine(
        model_path=str(tiny_llama_dir),
        attention_backend="example_sdpa",
        gemm_backend="example_gemm",
        backend_selection="priority",  # the kinds not named: by priority, not by a timing that load can sway
        max_total_tokens=2048,
        log_level="warning",
    ) as engine:
        assert engine.server_info()["backends"] == {
            "attention": "example_sdpa",
            "gemm": "example_gemm",
            "elementwise": "cpu_fused",
            "quantization": "none",
        }
        results = engine.generate(input_ids=prompts, sampling_params=params)
    assert [r["output_ids"] for r in results] == [r.output_ids for r in reference]


def test_gone_after_uninstall(installed: Path):
    proc = _pip("uninstall", "-y", DIST, cwd=installed)
    assert proc.returncode == 0, proc.stderr
    report = _plugins_json(installed)
    assert PLUGIN not in [p["name"] for p in report["plugins"]]
    names = {row["name"] for kind in ("attention", "gemm") for row in report["backends"][kind]}
    assert not names & {"example_sdpa", "example_gemm"}
