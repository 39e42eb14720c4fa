"""The plugin's own tests: the radixserve conformance kit, one line per backend.

Backends are looked up by name through the installed entry point, so install
the plugin first (``pip install -e .``). Only radixserve's public plugin API is
used (``radixserve.testing`` and the ``radixserve plugins`` command).
"""

import json
import subprocess
import sys

import pytest
import torch

from radixserve.testing import check_attention_backend, check_gemm_backend

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_attention_conforms(device):
    check_attention_backend("example_sdpa", device=device).raise_for_failures()


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_conforms(device):
    check_gemm_backend("example_gemm", device=device).raise_for_failures()


def test_registered_through_the_entry_point():
    # `radixserve plugins --json`, run through the module so no PATH entry is needed.
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "plugins", "--json"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    plugin = next((p for p in report["plugins"] if p["name"] == "example"), None)
    assert plugin is not None, [p["name"] for p in report["plugins"]]
    assert plugin["error"] is None
    assert plugin["registered"] == {"attention": ["example_sdpa"], "gemm": ["example_gemm"]}
