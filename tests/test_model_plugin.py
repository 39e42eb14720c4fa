"""A model architecture from a separate distribution: examples/model-plugin,
pip-installed into a directory of its own (``--target``, so this environment
stays as it was), is found through its ``radixserve`` entry point by an Engine
started in a subprocess with that directory on its path, serves a checkpoint
whose config names its architecture, and generates what the in-tree Llama
generates on the same weights."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from generation_utils import generate, make_scheduler, mixed_prompts

from radixserve.registry import get_registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "model-plugin"
DIST, PLUGIN, ARCH = "radixserve-example-model", "example-model", "ExampleLlamaForCausalLM"
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
# The reference backends, in both processes: nothing to load or time at start-up.
BACKENDS = {"attention_backend": "torch_native", "gemm_backend": "torch", "elementwise_backend": "torch_native"}

# Runs in the subprocess: what the registry says of the plugin, then the Engine's tokens.
SCRIPT = """
import json
from radixserve import Engine
from radixserve.registry import PluginRegistry

registry = PluginRegistry()
cls = registry.model_class({arch!r})
info = registry.plugins[{plugin!r}]
report = {{"class": cls.__module__ + "." + cls.__name__, "distribution": info.distribution,
          "error": info.error, "registered": info.registered}}
with Engine(model_path={model!r}, max_total_tokens=1024, log_level="warning", **{backends!r}) as engine:
    results = engine.generate(input_ids={prompts!r}, sampling_params={params!r})
report["output_ids"] = [r["output_ids"] for r in results]
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example installed into a directory of its own (built from a copy, so the
    source tree gets no build/ or *.egg-info)."""
    root = tmp_path_factory.mktemp("model-plugin")
    source = root / "model-plugin"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = root / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "install"]
        + ["--no-deps", "--no-build-isolation", "--target", str(target), str(source)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return target


def test_engine_serves_the_plugins_architecture(site: Path, tiny_llama_dir: Path, tmp_path: Path):
    assert ARCH not in get_registry().candidates["model"]  # not in-tree: only the plugin brings it
    model = tmp_path / "example-llama"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = [ARCH]
    (model / "config.json").write_text(json.dumps(config))
    prompts = mixed_prompts(512, [9, 21], seed=43)

    env = {k: v for k, v in os.environ.items() if k != "RADIXSERVE_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    script = SCRIPT.format(
        arch=ARCH, plugin=PLUGIN, model=str(model), prompts=prompts, params=GREEDY, backends=BACKENDS
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["class"] == f"radixserve_example_model.model.{ARCH}"
    assert report["distribution"] == DIST and report["error"] is None
    assert report["registered"] == {"model": [ARCH]}
    reference = generate(make_scheduler(tiny_llama_dir, **BACKENDS), prompts, **GREEDY)
    assert report["output_ids"] == [r.output_ids for r in reference]
