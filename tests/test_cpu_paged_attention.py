"""cpu_paged: decode attention read in place from the KV pool by a C++ kernel.

The conformance kit against torch_native (every dtype, page sizes 1 and 16,
prefixes, GQA 1-8, head dims 32-256, split long contexts, large ragged
batches); ``auto`` picks it on cpu, and ``torch_varlen`` when no compiler is
found; a build failure is a loud error naming the compiler's message; whole
generations give the same greedy tokens as torch_native. The kernel is built
once per machine (conftest builds it before the first test)."""

from __future__ import annotations

import pytest
import torch

from generation_utils import generate, make_scheduler, mixed_prompts
from radixserve.kernels import KernelQuery
from radixserve.registry import PluginError, get_registry
from radixserve.testing import check_attention_backend
from radixserve.testing.conformance import AttentionCase, make_attention_inputs
from radixserve_torch import attention_cpu_paged
from radixserve_torch.attention_cpu_paged import CpuPagedAttention, KernelBuildError

_lens = [(37 * i) % 1200 + 20 for i in range(40)]
EXTRA_CASES = (
    # One or two long requests: the kernel splits their keys across threads and merges.
    AttentionCase("decode/split/p1/gqa2/d64", "decode", 1, 16, 8, 64, (3000,), (1,)),
    AttentionCase("decode/split/p16/gqa8/d128", "decode", 16, 8, 1, 128, (1500, 40), (1, 1)),
    AttentionCase("decode/ragged40/p1/gqa2/d64", "decode", 1, 8, 4, 64, tuple(s - 1 for s in _lens), (1,) * 40),
    AttentionCase("decode/ragged24/p16/gqa8/d128", "decode", 16, 8, 1, 128,
                  tuple(s - 1 for s in _lens[:24]), (1,) * 24),
    # Head dims off the 32-wide fast path of the dot product.
    AttentionCase("decode/d32/p1/gqa2", "decode", 1, 4, 2, 32, (70, 5), (1, 1)),
    AttentionCase("decode/d80/p16/gqa1", "decode", 16, 2, 2, 80, (33, 200), (1, 1)),
    # Extend goes through torch_varlen's path, with and without cached prefixes.
    AttentionCase("extend/ragged/p16/gqa2/d64", "extend", 16, 4, 2, 64, (0, 300, 0, 17), (260, 90, 7, 150)),
)


def test_conformance_kit_passes_for_every_dtype():
    report = check_attention_backend("cpu_paged", device="cpu")
    print(report)
    report.raise_for_failures()
    assert {r.dtype for r in report.results} == {"float32", "bfloat16", "float16"}
    assert not report.skipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_conformance_kit_passes_on_split_ragged_and_odd_shapes(dtype):
    report = check_attention_backend("cpu_paged", device="cpu", dtypes=[dtype], cases=EXTRA_CASES)
    print(report)
    report.raise_for_failures()
    assert len(report.results) == len(EXTRA_CASES)


def test_strided_queries_from_a_fused_projection():
    case = EXTRA_CASES[2]
    inputs = make_attention_inputs(case, torch.bfloat16)
    backend = CpuPagedAttention(case.query("cpu", torch.bfloat16))
    backend.init_forward_metadata(inputs.batch)
    t, h, d = inputs.q.shape
    fused = torch.randn(t, (h + 4) * d).to(torch.bfloat16)  # q then other columns, as a QKV projection
    fused[:, : h * d] = inputs.q.reshape(t, h * d)
    q_view = fused[:, : h * d].view(t, h, d)
    assert not q_view.is_contiguous()
    expected = backend.forward_decode(inputs.q, inputs.layer, inputs.batch)
    assert torch.equal(backend.forward_decode(q_view, inputs.layer, inputs.batch), expected)


def test_auto_selects_it_on_cpu_and_torch_varlen_without_a_compiler(monkeypatch):
    registry = get_registry()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        query = KernelQuery(device="cpu", dtype=dtype, head_dim=64, num_heads=16, num_kv_heads=8)
        assert registry.select("attention", query) is CpuPagedAttention
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    assert CpuPagedAttention.unsupported_reasons(query) == [
        "no C++ compiler found (looked for 'no-such-c++-compiler' on PATH)"]
    assert registry.select("attention", query).name == "torch_varlen"
    with pytest.raises(PluginError, match=r"no C\+\+ compiler found"):
        registry.select("attention", query, "cpu_paged")
    cuda = KernelQuery(device="cuda", dtype=torch.bfloat16, head_dim=64, num_heads=16, num_kv_heads=8)
    assert "a CPU kernel; device is cuda" in CpuPagedAttention.unsupported_reasons(cuda)


def test_a_build_failure_is_loud_and_names_the_compiler_error(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(attention_cpu_paged, "SOURCE", broken)
    monkeypatch.setattr(attention_cpu_paged, "extension_name", lambda: "radixserve_cpu_paged_broken_test")
    monkeypatch.setattr(attention_cpu_paged, "_kernel", None)
    monkeypatch.setattr(attention_cpu_paged, "_build_error", None)
    query = KernelQuery(device="cpu", dtype=torch.float32, head_dim=64, num_heads=4, num_kv_heads=2)
    with pytest.raises(KernelBuildError, match=r"building the cpu_paged kernel failed: .*error.*this"):
        CpuPagedAttention(query)
    # Once failed in a process, the backend says so (and auto moves on) without building again.
    reasons = CpuPagedAttention.unsupported_reasons(query)
    assert len(reasons) == 1 and reasons[0].startswith("building the cpu_paged kernel failed:")
    assert get_registry().select("attention", query).name == "torch_varlen"


@pytest.mark.parametrize("page_size", [1, 16])
def test_generation_matches_torch_native(tiny_llama_dir, page_size):
    # Shared prefixes (radix hits), ragged lengths, chunked prefill over a cached prefix.
    prompts = mixed_prompts(512, [5, 60, 17, 33], seed=3, shared_prefix=40) + mixed_prompts(512, [90, 2, 47], seed=4)
    outputs = {}
    for backend in ("torch_native", "auto"):
        scheduler = make_scheduler(tiny_llama_dir, attention_backend=backend, page_size=page_size,
                                   chunked_prefill_size=64)
        name = scheduler.runner.summary()["backends"]["attention"]
        assert name == ("torch_native" if backend == "torch_native" else "cpu_paged")
        outputs[name] = [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=24, ignore_eos=True)]
    assert outputs["cpu_paged"] == outputs["torch_native"]
    assert all(len(o) == 24 for o in outputs["cpu_paged"])
