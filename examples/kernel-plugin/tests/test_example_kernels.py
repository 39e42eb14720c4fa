"""The plugin's own tests: the radixserve conformance kit, one line per backend.

Backends are looked up by name through the installed entry point, so install
the plugin first (``pip install -e .``)."""

import pytest
import torch

from radixserve.registry import PluginRegistry
from radixserve.testing import check_attention_backend, check_gemm_backend

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_attention_conforms(device):
    check_attention_backend("example_sdpa", device=device).raise_for_failures()


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_conforms(device):
    check_gemm_backend("example_gemm", device=device).raise_for_failures()


def test_registered_through_the_entry_point():
    registry = PluginRegistry()
    assert registry.candidates["attention"]["example_sdpa"].plugin == "example"
    assert registry.candidates["gemm"]["example_gemm"].plugin == "example"
    assert "example" not in registry.load_errors()
