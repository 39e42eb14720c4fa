"""torch_varlen: the CPU attention backend for ragged paged batches.

The conformance kit against torch_native (every dtype, page sizes 1 and 16,
prefixes, GQA 1-8, head dims 64/128, sliding windows and logit caps, plus
batches large and ragged enough to be split into several buckets, with and
without windows and caps); ``auto`` picks it on cpu when cpu_paged cannot
build (no C++ compiler); whole generations give
the same greedy tokens as torch_native."""

from __future__ import annotations

import pytest
import torch
from generation_utils import generate, make_scheduler, mixed_prompts

from radixserve.forward_batch import ForwardMode
from radixserve.kernels import KernelQuery
from radixserve.registry import get_registry
from radixserve.testing import check_attention_backend
from radixserve.testing.conformance import AttentionCase, make_attention_inputs
from radixserve_torch.attention_varlen import TorchVarlenAttention

# Ragged enough that the step plan cuts them into several buckets (asserted below).
_lens = [(37 * i) % 1200 + 20 for i in range(40)]
BUCKETED_CASES = (
    AttentionCase("decode/bucketed/p1/gqa2/d64", "decode", 1, 8, 4, 64, tuple(s - 1 for s in _lens), (1,) * 40),
    AttentionCase(
        "decode/bucketed/p16/gqa8/d128", "decode", 16, 8, 1, 128, tuple(s - 1 for s in _lens[:24]), (1,) * 24
    ),
    AttentionCase(
        "extend/bucketed/p16/gqa2/d64",
        "extend",
        16,
        4,
        2,
        64,
        (0, 300, 0, 17, 128, 0, 40),
        (260, 90, 7, 150, 33, 120, 1),
    ),
    AttentionCase("extend/bucketed/p1/gqa4/d128", "extend", 1, 8, 2, 128, (0, 0, 64, 5), (200, 31, 150, 90)),
    AttentionCase("extend/one-fresh-prompt/p1/gqa2/d64", "extend", 1, 4, 2, 64, (0,), (300,)),
    # Windows and caps over several buckets: each bucket's window masks (the fresh-prompt
    # buckets' too, which take is_causal without one) and the capped float32 paths.
    AttentionCase(
        "decode/bucketed/window300+softcap/p1/gqa2/d64",
        "decode",
        1,
        8,
        4,
        64,
        tuple(s - 1 for s in _lens),
        (1,) * 40,
        sliding_window=300,
        logit_softcap=5.0,
    ),
    AttentionCase(
        "extend/bucketed/window100/p16/gqa2/d64",
        "extend",
        16,
        4,
        2,
        64,
        (0, 300, 0, 17, 128, 0, 40),
        (260, 90, 7, 150, 33, 120, 1),
        sliding_window=100,
    ),
    AttentionCase(
        "extend/fresh-prompts/softcap/p1/gqa2/d64", "extend", 1, 4, 2, 64, (0, 0), (300, 40), logit_softcap=3.0
    ),
)


def test_conformance_kit_passes_for_every_dtype():
    report = check_attention_backend("torch_varlen", device="cpu")
    print(report)
    report.raise_for_failures()
    assert {r.dtype for r in report.results} == {"float32", "bfloat16", "float16"}
    assert not report.skipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_conformance_kit_passes_on_bucketed_batches(dtype):
    report = check_attention_backend("torch_varlen", device="cpu", dtypes=[dtype], cases=BUCKETED_CASES)
    print(report)
    report.raise_for_failures()
    assert len(report.results) == len(BUCKETED_CASES)


@pytest.mark.parametrize("case", BUCKETED_CASES[:4], ids=lambda c: c.name)
def test_bucketed_cases_really_use_several_buckets(case):
    inputs = make_attention_inputs(case, torch.float32)
    TorchVarlenAttention(case.query("cpu", torch.float32)).init_forward_metadata(inputs.batch)
    buckets = inputs.batch.attn_metadata.buckets
    assert len(buckets) > 1
    # Each bucket is padded to its own longest request, not the batch's.
    batch = inputs.batch
    seq_lens = batch.seq_lens_cpu
    work = (
        seq_lens
        if batch.mode is ForwardMode.DECODE
        else [n * s for n, s in zip(batch.extend_lens_cpu, seq_lens, strict=False)]
    )
    order = sorted(range(len(seq_lens)), key=lambda i: -work[i])  # the backend's order: most work first
    assert [b.seq_len for b in buckets] == [max(seq_lens[i] for i in order[b.start : b.end]) for b in buckets]


def test_auto_selects_it_on_cpu_without_compiled_kernels_or_a_cpp_compiler(monkeypatch, without_installed_kernels):
    # cpu_paged (priority 7) needs its kernels: the installation's, else a compiler to build them.
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    registry = get_registry()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        query = KernelQuery(device="cpu", dtype=dtype, head_dim=64, num_heads=16, num_kv_heads=8)
        assert registry.select("attention", query) is TorchVarlenAttention
    assert registry.select("attention", query, "torch_native").name == "torch_native"


@pytest.mark.parametrize("page_size", [1, 16])
def test_generation_matches_torch_native(tiny_llama_dir, page_size):
    # Shared prefixes (radix hits), ragged lengths, chunked prefill over a cached prefix.
    prompts = mixed_prompts(512, [5, 60, 17, 33], seed=3, shared_prefix=40) + mixed_prompts(512, [90, 2, 47], seed=4)
    outputs = {}
    for backend in ("torch_native", "torch_varlen"):
        scheduler = make_scheduler(
            tiny_llama_dir, attention_backend=backend, page_size=page_size, chunked_prefill_size=64
        )
        assert scheduler.runner.summary()["backends"]["attention"] == backend
        results = generate(scheduler, prompts, max_new_tokens=24, ignore_eos=True)
        outputs[backend] = [r.output_ids for r in results]
    assert outputs["torch_varlen"] == outputs["torch_native"]
    assert all(len(o) == 24 for o in outputs["torch_varlen"])
