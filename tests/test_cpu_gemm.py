"""The CPU GEMM backends. ``onednn``: weights packed once after loading, selected
by default on cpu in float32 (and bfloat16 where ``cpu_bf16`` does not apply),
conformant, and a model served with it generates what the ``torch`` GEMM
generates. ``cpu_bf16``: our bfloat16 kernel on AVX512-BF16 CPUs, selected ahead
of ``onednn`` there, conformant on every row count and shape edge, and a model
on it is as close to the float32 model as one on ``onednn``."""

from __future__ import annotations

import pytest
import torch

from generation_utils import generate, make_scheduler, mixed_prompts
from radixserve.kernels import KernelQuery
from radixserve.layers.linear import linear_layers
from radixserve.registry import get_registry
from radixserve.testing.conformance import GemmCase, check_gemm_backend, check_quantization_method
from radixserve_torch.gemm import CpuBf16Gemm, OneDnnGemm

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
    bf16 = KernelQuery(device="cpu", dtype=torch.bfloat16)
    assert registry.select("gemm", KernelQuery(device="cpu", dtype=torch.float32), "auto").name == "onednn"
    expected_bf16 = "cpu_bf16" if not CpuBf16Gemm.unsupported_reasons(bf16) else "onednn"
    assert registry.select("gemm", bf16, "auto").name == expected_bf16
    assert registry.select("gemm", KernelQuery(device="cpu", dtype=torch.float16), "auto").name == "torch"
    assert OneDnnGemm.unsupported_reasons(KernelQuery(device="cuda", dtype=torch.bfloat16)) == [
        "runs on cpu only, not 'cuda'"]
    assert CpuBf16Gemm.unsupported_reasons(KernelQuery(device="cuda", dtype=torch.float32))[:2] == [
        "runs on cpu only, not 'cuda'", "dtype torch.float32 is not bfloat16"]


def test_model_on_onednn_holds_packed_weights_and_generates_as_torch(tiny_llama_dir):
    prompts = mixed_prompts(512, [7, 29, 64], seed=3)
    onednn = make_scheduler(tiny_llama_dir)
    assert onednn.runner.backends["gemm"] == "onednn"
    layers = linear_layers(onednn.runner.model)
    assert layers and all(layer.weight.is_mkldnn for layer in layers)  # one packed copy, no dense one
    assert onednn.runner.model.lm_head.weight.is_mkldnn  # the untied LM head is packed too
    reference = make_scheduler(tiny_llama_dir, gemm_backend="torch")
    ours = generate(onednn, prompts, max_new_tokens=24, ignore_eos=True)
    ref = generate(reference, prompts, max_new_tokens=24, ignore_eos=True)
    assert [r.output_ids for r in ours] == [r.output_ids for r in ref]


BF16_REASONS = CpuBf16Gemm.unsupported_reasons(KernelQuery(device="cpu", dtype=torch.bfloat16))
needs_avx512_bf16 = pytest.mark.skipif(bool(BF16_REASONS), reason="; ".join(BF16_REASONS))

# Row counts around the 6-row register tile, column counts around the 4-strip
# (64-column) tile, and a K long enough that float32 accumulation order matters.
BF16_EDGE_CASES = [GemmCase(f"M{m}/K{k}/N{n}{'/bias' if bias else ''}", (m,), k, n, bias)
                   for m, k, n, bias in ((1, 2, 16, False), (6, 64, 64, True), (7, 128, 80, True),
                                         (13, 96, 112, False), (64, 1024, 1040, True), (130, 2816, 48, False))]


@needs_avx512_bf16
def test_cpu_bf16_is_conformant_on_packed_weights():
    for cases in ("full", BF16_EDGE_CASES):
        report = check_gemm_backend("cpu_bf16", cases=cases)
        print(report)
        report.raise_for_failures()
        assert {r.dtype for r in report.results} == {"bfloat16"}


@needs_avx512_bf16
def test_cpu_bf16_packs_what_its_kernel_takes_and_runs_the_rest_dense():
    gemm = CpuBf16Gemm(KernelQuery(device="cpu", dtype=torch.bfloat16))
    packed = gemm.prepare_weight(torch.randn(48, 64).to(torch.bfloat16))
    assert packed.shape == (3, 32, 16, 2)  # strips of 16 columns, pairs of in features
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    assert gemm.linear(x, packed).shape == (2, 5, 48)
    for shape in ((40, 64), (48, 63)):  # out features not a multiple of 16; odd in features
        weight = torch.randn(*shape).to(torch.bfloat16)
        assert gemm.prepare_weight(weight) is weight
        x = torch.randn(3, shape[1]).to(torch.bfloat16)
        assert torch.equal(gemm.linear(x, weight), torch.nn.functional.linear(x, weight))
    # The int8 method hands a dense dequantized weight to linear on every call.
    report = check_quantization_method("int8", gemm="cpu_bf16", dtypes=[torch.bfloat16])
    report.raise_for_failures()


@needs_avx512_bf16
def test_bf16_model_on_cpu_bf16_is_as_close_to_float32_as_on_onednn(tiny_model_factory):
    # Wide enough (K up to 768) that the two kernels' float32 sums round differently.
    model_dir = tiny_model_factory(hidden_size=256, intermediate_size=768, num_heads=4, num_kv_heads=2)
    prompts = mixed_prompts(512, [9, 40, 23], seed=11)

    def prompt_logprobs(**server_args):
        scheduler = make_scheduler(model_dir, **server_args)
        results = generate(scheduler, prompts, max_new_tokens=1, return_logprob=True, logprob_start_len=0)
        return scheduler, torch.tensor([lp for r in results for lp, _ in r.input_logprobs[1:]])

    scheduler, ours = prompt_logprobs(dtype="bfloat16")
    assert scheduler.runner.backends["gemm"] == "cpu_bf16"
    layers = linear_layers(scheduler.runner.model)
    assert layers and all(layer.weight.dim() == 4 for layer in layers)  # packed, one copy
    assert scheduler.runner.model.lm_head.weight.dim() == 4
    _, onednn = prompt_logprobs(dtype="bfloat16", gemm_backend="onednn")
    _, reference = prompt_logprobs(dtype="float32", gemm_backend="torch")
    ours_error, onednn_error = (ours - reference).abs().mean(), (onednn - reference).abs().mean()
    print(f"mean |logprob error| vs float32: cpu_bf16 {ours_error:.4f}, onednn {onednn_error:.4f}")
    assert not torch.equal(ours, onednn)
    assert ours_error <= 1.5 * onednn_error + 1e-3, (ours_error, onednn_error)


@needs_avx512_bf16
def test_a_tied_lm_head_keeps_the_embedding_table_dense(tiny_model_factory):
    model_dir = tiny_model_factory(tie_word_embeddings=True)
    scheduler = make_scheduler(model_dir, dtype="bfloat16")
    model = scheduler.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dim() == 2
    reference = make_scheduler(model_dir, dtype="bfloat16", gemm_backend="torch")
    prompts = mixed_prompts(512, [12, 30], seed=2)
    ours, want = (generate(s, prompts, max_new_tokens=8, ignore_eos=True) for s in (scheduler, reference))
    assert [r.output_ids for r in ours] == [r.output_ids for r in want]
