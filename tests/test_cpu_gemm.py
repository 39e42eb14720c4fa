"""The ``onednn`` GEMM backend: weights packed once after loading, selected by
default on cpu in float32 and bfloat16, conformant, and a model served with
it generates what the ``torch`` GEMM generates."""

from __future__ import annotations

import pytest
import torch

from generation_utils import generate, make_scheduler, mixed_prompts
from radixserve.kernels import KernelQuery
from radixserve.layers.linear import linear_layers
from radixserve.registry import get_registry
from radixserve.testing.conformance import check_gemm_backend, check_quantization_method
from radixserve_torch.gemm import OneDnnGemm

DTYPES = [torch.float32, torch.bfloat16]


def test_onednn_is_conformant_with_packed_weights():
    # The kit runs linear on the weight as prepare_weight leaves it (packed here).
    report = check_gemm_backend("onednn", cases="full")
    report.raise_for_failures()
    assert {r.dtype for r in report.results} == {"float32", "bfloat16"}
    assert "float16" in str(report)  # skipped, with its reason


@pytest.mark.parametrize("method", ["none", "int8"])
def test_quantization_methods_run_on_onednn(method):
    # none packs the weight after loading; int8 hands a dense dequantized weight per call.
    report = check_quantization_method(method, gemm="onednn", dtypes=DTYPES)
    report.raise_for_failures()
    assert len(report.results) == 8


def test_packed_weight_gives_the_dense_result_exactly():
    gemm = OneDnnGemm(KernelQuery(device="cpu", dtype=torch.float32))
    weight, bias = torch.randn(48, 64), torch.randn(48)
    packed = gemm.prepare_weight(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    for rows in (1, 5, 33):
        x = torch.randn(rows, 64)
        assert torch.equal(gemm.linear(x, packed, bias), gemm.linear(x, weight, bias))
        torch.testing.assert_close(gemm.linear(x, packed, bias), torch.nn.functional.linear(x, weight, bias))


def test_selection_prefers_onednn_on_cpu_where_it_applies():
    registry = get_registry()
    for dtype in DTYPES:
        assert registry.select("gemm", KernelQuery(device="cpu", dtype=dtype), "auto").name == "onednn"
    assert registry.select("gemm", KernelQuery(device="cpu", dtype=torch.float16), "auto").name == "torch"
    assert OneDnnGemm.unsupported_reasons(KernelQuery(device="cuda", dtype=torch.bfloat16)) == [
        "runs on cpu only, not 'cuda'"]


def test_model_on_onednn_holds_packed_weights_and_generates_as_torch(tiny_llama_dir):
    prompts = mixed_prompts(512, [7, 29, 64], seed=3)
    onednn = make_scheduler(tiny_llama_dir)
    assert onednn.runner.backends["gemm"] == "onednn"
    layers = linear_layers(onednn.runner.model)
    assert layers and all(layer.weight.is_mkldnn for layer in layers)  # one packed copy, no dense one
    reference = make_scheduler(tiny_llama_dir, gemm_backend="torch")
    ours = generate(onednn, prompts, max_new_tokens=24, ignore_eos=True)
    ref = generate(reference, prompts, max_new_tokens=24, ignore_eos=True)
    assert [r.output_ids for r in ours] == [r.output_ids for r in ref]
