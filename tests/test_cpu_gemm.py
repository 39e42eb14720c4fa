"""The CPU GEMM backends. ``onednn``: weights packed once after loading, selected
by default on cpu where ``cpu_packed`` does not apply, conformant, and a model
served with it generates what the ``torch`` GEMM generates. ``cpu_packed``: our
kernels on AVX-512 CPUs (bfloat16 with AVX512-BF16) and, in float32, on AVX2 ones,
selected ahead of ``onednn`` there, conformant on every row count and shape edge, a float32 model
on it generates what the ``torch`` GEMM generates, and a bfloat16 model on it is
as close to the float32 model as one on ``onednn``."""

from __future__ import annotations

import pytest
import torch
from generation_utils import generate, make_scheduler, mixed_prompts

from radixserve.kernels import KernelQuery
from radixserve.layers.linear import linear_layers
from radixserve.registry import get_registry
from radixserve.testing.conformance import GEMM_CASES, GemmCase, check_gemm_backend, check_quantization_method
from radixserve_torch import cpu_isa, cpu_kernels
from radixserve_torch.elementwise_cpu import CpuFusedElementwise
from radixserve_torch.gemm import CpuPackedGemm, OneDnnGemm, TorchGemm

DTYPES = [torch.float32, torch.bfloat16]
# oneDNN's bfloat16 needs AVX-512 (or AVX-NE-CONVERT): not on an AVX2-only CPU.
ONEDNN_DTYPES = [d for d in DTYPES if not OneDnnGemm.unsupported_reasons(KernelQuery(device="cpu", dtype=d))]


def test_onednn_is_conformant_with_packed_weights():
    # The kit runs linear on the weight as prepare_weight leaves it (packed here).
    report = check_gemm_backend("onednn", cases="full")
    report.raise_for_failures()
    assert {r.dtype for r in report.results} == {str(d).removeprefix("torch.") for d in ONEDNN_DTYPES}
    assert "float16" in str(report)  # skipped, with its reason


@pytest.mark.parametrize("method", ["none", "int8"])
def test_quantization_methods_run_on_onednn(method):
    # none packs the weight after loading; int8 hands a dense dequantized weight per call.
    report = check_quantization_method(method, gemm="onednn", dtypes=ONEDNN_DTYPES)
    report.raise_for_failures()
    assert len(report.results) == 4 * len(ONEDNN_DTYPES)


def test_packed_weight_gives_the_dense_result_exactly():
    gemm = OneDnnGemm(KernelQuery(device="cpu", dtype=torch.float32))
    weight, bias = torch.randn(48, 64), torch.randn(48)
    packed = gemm.prepare_weight(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    for rows in (1, 5, 33):
        x = torch.randn(rows, 64)
        assert torch.equal(gemm.linear(x, packed, bias), gemm.linear(x, weight, bias))
        torch.testing.assert_close(gemm.linear(x, packed, bias), torch.nn.functional.linear(x, weight, bias))


def test_selection_prefers_our_kernels_then_onednn_on_cpu():
    registry = get_registry()
    for dtype in DTYPES:
        query = KernelQuery(device="cpu", dtype=dtype)
        usable = [b.name for b in (CpuPackedGemm, OneDnnGemm) if not b.unsupported_reasons(query)]
        assert registry.select("gemm", query, "auto").name == (usable + ["torch"])[0]
    assert registry.select("gemm", KernelQuery(device="cpu", dtype=torch.float16), "auto").name == "torch"
    assert OneDnnGemm.unsupported_reasons(KernelQuery(device="cuda", dtype=torch.float32)) == [
        "runs on cpu only, not 'cuda'"
    ]
    assert CpuPackedGemm.unsupported_reasons(KernelQuery(device="cuda", dtype=torch.float16))[:2] == [
        "runs on cpu only, not 'cuda'",
        "dtype torch.float16 is not float32 or bfloat16",
    ]


def test_model_on_onednn_holds_packed_weights_and_generates_as_torch(tiny_llama_dir):
    prompts = mixed_prompts(512, [7, 29, 64], seed=3)
    onednn = make_scheduler(tiny_llama_dir, gemm_backend="onednn")
    layers = linear_layers(onednn.runner.model)
    assert layers and all(layer.weight.is_mkldnn for layer in layers)  # one packed copy, no dense one
    assert onednn.runner.model.lm_head.weight.is_mkldnn  # the untied LM head is packed too
    reference = make_scheduler(tiny_llama_dir, gemm_backend="torch")
    ours = generate(onednn, prompts, max_new_tokens=24, ignore_eos=True)
    ref = generate(reference, prompts, max_new_tokens=24, ignore_eos=True)
    assert [r.output_ids for r in ours] == [r.output_ids for r in ref]


def _reasons(dtype: torch.dtype) -> list[str]:
    return CpuPackedGemm.unsupported_reasons(KernelQuery(device="cpu", dtype=dtype))


PACKED_DTYPES = [
    pytest.param(dtype, marks=pytest.mark.skipif(bool(_reasons(dtype)), reason="; ".join(_reasons(dtype))))
    for dtype in DTYPES
]

# Row counts around the 6-row register tile, column counts around the 4-strip
# (64-column) tile, and a K long enough that float32 accumulation order matters.
EDGE_CASES = [
    GemmCase(f"M{m}/K{k}/N{n}{'/bias' if bias else ''}", (m,), k, n, bias)
    for m, k, n, bias in (
        (1, 2, 16, False),
        (6, 64, 64, True),
        (7, 128, 80, True),
        (13, 96, 112, False),
        (64, 1024, 1040, True),
        (130, 2816, 48, False),
    )
]
# The fused gate/up + SiLU: one gate strip (a tile of two strips), three (a full
# tile and a short one), and row counts off the 6-row tile.
EDGE_CASES += [
    GemmCase(f"M{m}/K{k}/N{n}{'/bias' if bias else ''}/silu_and_mul", (m,), k, n, bias, silu_and_mul=True)
    for m, k, n, bias in ((1, 2, 32, False), (7, 128, 96, True), (13, 96, 160, False), (130, 2816, 64, True))
]
# AMX's blocks (bfloat16, 12 rows or more, K a multiple of 32): 32 rows x 2 strips, a
# strip left alone (odd strip counts), padded last rows, two chunks of rows (K 3,104:
# chunks of 96 rows) and four pieces of K (1,024 in features each, the last 32); and a
# K off the 32-step, which takes the AVX-512 tiles.
EDGE_CASES += [
    GemmCase(f"M{m}/K{k}/N{n}{'/bias' if bias else ''}{'/silu_and_mul' if gated else ''}", (m,), k, n, bias, gated)
    for m, k, n, bias, gated in (
        (12, 64, 48, True, False),
        (33, 96, 112, False, False),
        (161, 3104, 48, True, False),
        (45, 544, 96, True, True),
        (20, 112, 64, False, False),
    )
]


@pytest.mark.parametrize("dtype", PACKED_DTYPES, ids=str)
def test_cpu_packed_is_conformant_on_packed_weights(dtype):
    for cases in ("full", EDGE_CASES):
        report = check_gemm_backend("cpu_packed", dtypes=[dtype], cases=cases)
        print(report)
        report.raise_for_failures()
        assert len(report.results) == len(cases if isinstance(cases, list) else GEMM_CASES[cases])


def test_amx_is_used_where_the_build_has_it_and_hidden_with_onednn(monkeypatch):
    amx, target = cpu_isa.amx_allowed(), cpu_isa.build_target()
    if not CpuPackedGemm.unsupported_reasons(KernelQuery(device="cpu", dtype=torch.float32)):
        assert cpu_kernels.uses_amx() == amx.allowed
    # The setting that hides AMX from oneDNN hides it from our kernels (the class without AMX).
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    can = cpu_isa.amx_allowed().allowed
    assert can == (target is not None and {"amx_bf16", "amx_tile"} <= target.features)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    hidden = cpu_isa.amx_allowed()
    assert not hidden.allowed and ("AVX512_CORE_BF16" in hidden.reason or not can), hidden.reason


@pytest.mark.parametrize("dtype", PACKED_DTYPES, ids=str)
def test_cpu_packed_packs_what_its_kernels_take_and_runs_the_rest_dense(dtype):
    gemm = CpuPackedGemm(KernelQuery(device="cpu", dtype=dtype))
    group = 2 if dtype == torch.bfloat16 else 1  # in features per 64-byte weight load
    packed = gemm.prepare_weight(torch.randn(48, 64).to(dtype))
    assert packed.shape == (3, 64 // group, 16, group)  # strips of 16 columns
    x = torch.randn(2, 5, 64).to(dtype)
    assert gemm.linear(x, packed).shape == (2, 5, 48)
    # A dense weight of a shape the kernels take is packed per call: the same result.
    dense = torch.randn(32, 64).to(dtype)
    assert torch.equal(gemm.linear(x, dense), gemm.linear(x, gemm.prepare_weight(dense)))
    dense_shapes = [(40, 64)] + ([(48, 63)] if dtype == torch.bfloat16 else [])  # not a multiple of 16; odd K
    for shape in dense_shapes:
        weight = torch.randn(*shape).to(dtype)
        assert gemm.prepare_weight(weight) is weight
        x = torch.randn(3, shape[1]).to(dtype)
        assert torch.equal(gemm.linear(x, weight), torch.nn.functional.linear(x, weight))
    # The int8 method hands a dense dequantized weight to linear on every call (tests/test_engine.py
    # checks that an int8 model generates exactly what its dequantized checkpoint does).
    report = check_quantization_method("int8", gemm="cpu_packed", dtypes=[dtype])
    report.raise_for_failures()


@pytest.mark.parametrize("dtype", PACKED_DTYPES, ids=str)
def test_fused_silu_and_mul_gives_the_bits_of_linear_then_silu_and_mul(dtype):
    gemm = CpuPackedGemm(KernelQuery(device="cpu", dtype=dtype))
    act = CpuFusedElementwise(KernelQuery(device="cpu", dtype=dtype))
    x, weight, bias = torch.randn(2, 9, 96).to(dtype), torch.randn(96, 96).to(dtype), torch.randn(96).to(dtype)
    packed = gemm.prepare_weight(weight)
    fused = gemm.linear_silu_and_mul(x, packed, bias)
    assert fused.shape == (2, 9, 48)
    assert torch.equal(fused, act.silu_and_mul(gemm.linear(x, packed, bias)))
    # Gate and up not whole 16-column strips (3 strips), or a weight the kernels do not pack:
    # no fused kernel, and the layer runs linear and then the elementwise op.
    assert gemm.linear_silu_and_mul(x[..., :64], gemm.prepare_weight(weight[:48, :64])) is None
    assert gemm.linear_silu_and_mul(x, weight[:40]) is None


@pytest.mark.parametrize("dtype", PACKED_DTYPES[:1], ids=str)
def test_float32_model_on_cpu_packed_generates_as_torch(tiny_llama_dir, dtype):
    prompts = mixed_prompts(512, [7, 29, 64], seed=3)
    ours = make_scheduler(tiny_llama_dir, dtype=str(dtype).removeprefix("torch."), gemm_backend="cpu_packed")
    assert ours.runner.backends["gemm"] == "cpu_packed"
    model = ours.runner.model
    assert all(layer.weight.dim() == 4 for layer in linear_layers(model)) and model.lm_head.weight.dim() == 4
    reference = make_scheduler(tiny_llama_dir, gemm_backend="torch")
    got, want = (generate(s, prompts, max_new_tokens=24, ignore_eos=True) for s in (ours, reference))
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


@pytest.mark.parametrize("dtype", PACKED_DTYPES[1:], ids=str)
def test_bf16_model_on_cpu_packed_is_as_close_to_float32_as_on_onednn(tiny_model_factory, dtype):
    # Wide enough (K up to 768) that the two kernels' float32 sums round differently.
    model_dir = tiny_model_factory(hidden_size=256, intermediate_size=768, num_heads=4, num_kv_heads=2)
    prompts = mixed_prompts(512, [9, 40, 23], seed=11)

    def prompt_logprobs(**server_args):
        scheduler = make_scheduler(model_dir, **server_args)
        results = generate(scheduler, prompts, max_new_tokens=1, return_logprob=True, logprob_start_len=0)
        return scheduler, torch.tensor([lp for r in results for lp, _ in r.input_logprobs[1:]])

    scheduler, ours = prompt_logprobs(dtype=str(dtype).removeprefix("torch."), gemm_backend="cpu_packed")
    assert scheduler.runner.backends["gemm"] == "cpu_packed"
    model = scheduler.runner.model
    assert all(layer.weight.dim() == 4 for layer in linear_layers(model)) and model.lm_head.weight.dim() == 4
    _, onednn = prompt_logprobs(dtype="bfloat16", gemm_backend="onednn")
    _, reference = prompt_logprobs(dtype="float32", gemm_backend="torch")
    ours_error, onednn_error = (ours - reference).abs().mean(), (onednn - reference).abs().mean()
    print(f"mean |logprob error| vs float32: cpu_packed {ours_error:.4f}, onednn {onednn_error:.4f}")
    # On AMX both take tile products summed over K in the same order, to the same bits;
    # elsewhere our AVX-512 sums round differently from oneDNN's.
    assert torch.equal(ours, onednn) == cpu_kernels.uses_amx()
    assert ours_error <= 1.5 * onednn_error + 1e-3, (ours_error, onednn_error)


@pytest.mark.parametrize("dtype", PACKED_DTYPES[1:], ids=str)
def test_a_tied_lm_head_keeps_the_embedding_table_dense(tiny_model_factory, dtype):
    """The embedding reads the dense table; the head its own packed copy, made once (the
    kernel would otherwise pack the dense table at every step)."""
    model_dir = tiny_model_factory(tie_word_embeddings=True)
    scheduler = make_scheduler(model_dir, dtype=str(dtype).removeprefix("torch."), gemm_backend="cpu_packed")
    model = scheduler.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dim() == 2
    assert model.lm_head.prepared_weight is not None and model.lm_head.prepared_weight.dim() == 4
    reference = make_scheduler(model_dir, dtype="bfloat16", gemm_backend="torch")
    prompts = mixed_prompts(512, [12, 30], seed=2)
    ours, want = (generate(s, prompts, max_new_tokens=8, ignore_eos=True) for s in (scheduler, reference))
    assert [r.output_ids for r in ours] == [r.output_ids for r in want]


@pytest.mark.parametrize(
    ("saved", "served", "weight_dtype"),
    [
        (torch.bfloat16, torch.float32, torch.bfloat16),  # CPUs without bfloat16 dot products
        (torch.float16, torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16, None),
        (torch.float32, torch.float32, None),
    ],
)
def test_a_16_bit_checkpoint_served_wider_names_its_weight_dtype(saved, served, weight_dtype):
    """What the weights hold exactly, for the GEMM backends (cpu_packed stores them so on
    AVX2) and auto's timing, which rounds its weights to it."""
    from transformers import LlamaConfig

    from radixserve.backend_timing import timing_cases
    from radixserve.checkpoints.loader import model_kernel_query, model_timing_shapes

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        architectures=["LlamaForCausalLM"],
        dtype=saved,
    )
    query = model_kernel_query(config, "cpu", served)
    assert query.weight_dtype == weight_dtype
    drawn = []

    class Recording(TorchGemm):
        def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
            drawn.append(weight)
            return weight

    shapes = model_timing_shapes(config, query, tp_size=1, decode_rows=4, prefill_rows=16, context_length=64)
    case = timing_cases("gemm", query, shapes, torch.device("cpu"))[0]
    case.setup(Recording(query))
    assert drawn and all(w.dtype == served for w in drawn)
    narrow = weight_dtype or served
    assert all(torch.equal(w.to(narrow).to(served), w) for w in drawn)
    if served == torch.float32 and weight_dtype is None:  # a float32 checkpoint: float32 weights
        assert not all(torch.equal(w.bfloat16().float(), w) for w in drawn)
