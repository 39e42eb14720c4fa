"""Batched LoRA kernels: ``LoRABatch.of``, the conformance kit on the torch
backends and on Triton (in its interpreter, and compiled for GPU targets), the
kit failing wrong backends, and ``auto``'s timing cases."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch

from radixserve.backend_timing import MeasuredSelection, ModelShapes, TimingCache, timing_cases
from radixserve.kernels import NO_ADAPTER, KernelQuery, LoRABatch, LoRASegment
from radixserve.kernels.cases import make_lora_inputs
from radixserve.registry import PluginRegistry
from radixserve.testing import LORA_CASES, LoRACase, check_lora_backend
from radixserve_torch import cpu_kernels
from radixserve_torch.lora import TorchGroupedLoRA, TorchNativeLoRA
from radixserve_torch.lora_cpu import CpuSgmvLoRA
from radixserve_torch.platform import CpuPlatform

N = NO_ADAPTER
CPU = torch.device("cpu")
has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
needs_cpu_kernels = pytest.mark.skipif(
    bool(cpu_kernels.unavailable_reasons()), reason="; ".join(cpu_kernels.unavailable_reasons())
)

# --------------------------------------------------------------------------
# LoRABatch.of


def test_neighbouring_requests_of_one_slot_make_one_run():
    batch = LoRABatch.of([3, 2, 1, 4], [1, 1, 0, 1], CPU)
    assert batch.segments == [LoRASegment(0, 5, 1), LoRASegment(5, 1, 0), LoRASegment(6, 4, 1)]
    assert batch.num_tokens == 10 and batch.max_segment_len == 5 and batch.slots == [0, 1]
    assert batch.seg_start.tolist() == [0, 5, 6] and batch.seg_len.tolist() == [5, 1, 4]
    assert batch.seg_slot.tolist() == [1, 0, 1]
    assert {t.dtype for t in (batch.seg_start, batch.seg_len, batch.seg_slot, batch.token_slot)} == {torch.int32}


def test_base_requests_make_no_run_and_split_runs():
    batch = LoRABatch.of([2, 3, 0, 1, 2], [4, N, 2, 4, N], CPU)  # request 2 has no tokens: no run
    assert batch.segments == [LoRASegment(0, 2, 4), LoRASegment(5, 1, 4)]
    assert batch.token_slot.tolist() == [4, 4, N, N, N, 4, N, N]
    assert batch.slots == [4]


def test_no_adapter_tokens():
    for counts, slots in (([], []), ([3, 1], [N, N])):
        batch = LoRABatch.of(counts, slots, CPU)
        assert batch.segments == [] and batch.slots == [] and batch.max_segment_len == 0
        assert batch.seg_start.numel() == 0 and batch.rows_by_slot() == {}
        assert batch.token_slot.tolist() == [N] * sum(counts)


def test_rows_by_slot_gathers_every_run_of_a_slot_once():
    batch = LoRABatch.of([1, 1, 1, 2, 1], [0, 3, N, 0, 3], CPU)
    rows = batch.rows_by_slot()
    assert {slot: index.tolist() for slot, index in rows.items()} == {0: [0, 3, 4], 3: [1, 5]}
    assert all(index.dtype == torch.int64 for index in rows.values())
    assert batch.rows_by_slot() is rows  # made once, shared by every layer of the step


def test_case_checks_its_slots_and_splits():
    with pytest.raises(ValueError, match="outside"):
        LoRACase("bad", (1, 1), (0, 2), 16, 16, 8, 2)
    qkv = LoRACase("qkv", (1,), (0,), 16, 48, 8, 1, fused=3)
    assert qkv.rank_columns == 24 and qkv.out_splits == (24, 12, 12)  # q != kv
    assert LoRACase("gate_up", (1,), (0,), 16, 48, 8, 1, fused=2).out_splits == (24, 24)
    assert LoRACase("o", (1,), (0,), 16, 48, 8, 1).out_splits == (48,)
    assert LoRACase("gqa", (1,), (0,), 16, 48, 8, 1, fused=3, out_splits=(32, 8, 8)).out_splits == (32, 8, 8)
    for fused, splits in ((3, (32, 8)), (3, (32, 8, 9)), (1, (40, 8))):
        with pytest.raises(ValueError, match="out_splits"):
            LoRACase("bad", (1,), (0,), 16, 48, 8, 1, fused=fused, out_splits=splits)


def test_make_lora_inputs_shapes():
    case = LoRACase("qkv", (3, 2), (1, N), 16, 48, 8, 2, fused=3)
    x, out, a, b, batch, splits = make_lora_inputs(case, torch.float32, CPU)
    assert x.shape == (5, 16) and out.shape == (5, 48) and batch.num_tokens == 5
    assert a.shape == (2, 24, 16) and b.shape == (2, 48, 8) and splits == (24, 12, 12)


# --------------------------------------------------------------------------
# The kit: the torch backends pass, Triton passes in the interpreter and compiles for GPUs


@pytest.mark.parametrize("backend", ["torch_native", "torch_grouped"])
def test_torch_backends_pass(backend):
    report = check_lora_backend(backend)
    report.raise_for_failures(min_run=3 * len(LORA_CASES["standard"]))
    assert {r.dtype for r in report.results} == {"float32", "bfloat16", "float16"}


class SgmvOnEveryBatch(CpuSgmvLoRA):
    """``cpu_sgmv`` with no batch handed to ``torch_grouped``: its C++ loops on the prefill cases too."""

    name = "cpu_sgmv_every_batch"
    PREFILL_RUN = 1 << 30


@needs_cpu_kernels
@pytest.mark.parametrize("backend", ["cpu_sgmv", SgmvOnEveryBatch])
def test_the_cpu_kernel_passes(backend):
    report = check_lora_backend(backend)
    report.raise_for_failures(min_run=3 * len(LORA_CASES["standard"]))
    assert {r.dtype for r in report.results} == {"float32", "bfloat16", "float16"}


@needs_cpu_kernels
def test_the_cpu_kernel_hands_a_prefill_with_a_long_run_to_torch_grouped(monkeypatch):
    """A batch of one run per slot, some longer than ``PREFILL_RUN``, runs torch's matmuls on views;
    any other batch (interleaved runs however long, short prefills) runs the C++ loops."""
    calls = []
    monkeypatch.setattr(TorchGroupedLoRA, "apply", lambda self, *args: calls.append(args[4].max_segment_len))
    backend = CpuSgmvLoRA(KernelQuery(device="cpu", dtype=torch.float32, max_lora_rank=8))
    run = CpuSgmvLoRA.PREFILL_RUN
    batches = [  # (tokens of each request, their slots, whether torch_grouped serves it)
        ((run, run), (0, 1), False),
        ((run + 1, 1), (0, 1), True),
        ((run + 1, 3, run + 1), (0, N, 0), False),  # slot 0 has two runs
        ((1, 1, 1), (0, 1, 0), False),  # a decode step
    ]
    for counts, slots, grouped in batches:
        x, out, a, b, batch, splits = make_lora_inputs(LoRACase("run", counts, slots, 32, 24, 8, 2), torch.float32, CPU)
        before, served = out.clone(), len(calls)
        backend.apply(x, out, a, b, batch, splits)
        assert (len(calls) > served) == grouped
        assert (out != before).any() != grouped  # the C++ kernel wrote its update
    assert calls == [run + 1]


def test_case_set_covers_the_contract():
    cases = LORA_CASES["standard"]
    assert any(c.num_tokens == 0 for c in cases)  # empty batch
    assert any(c.num_tokens and set(c.request_slots) == {N} for c in cases)  # base model only
    assert any(N in c.request_slots and set(c.request_slots) != {N} for c in cases)  # base rows among runs
    assert any(set(c.token_counts) == {1} and len(set(c.request_slots)) > 2 for c in cases)  # decode, interleaved
    assert any(min(s for s in c.request_slots if s != N) > 0 for c in cases if set(c.request_slots) - {N})
    assert any(c.rank_columns & (c.rank_columns - 1) for c in cases)  # K not a power of two
    assert any(c.fused == 3 for c in cases) and any(max(c.token_counts, default=0) > 64 for c in cases)
    # q/k/v of unequal sizes whose boundaries fall inside a 64-column block; a rank not a power of two
    assert any(c.fused == 3 and len(set(c.out_splits)) > 1 and c.out_splits[0] % 64 for c in cases)
    assert any(c.fused > 1 and c.rank & (c.rank - 1) for c in cases)


@has_triton
def test_triton_passes_in_the_interpreter():
    # A subprocess: Triton reads TRITON_INTERPRET when the kernels are defined.
    code = textwrap.dedent("""
        from radixserve.testing import LORA_CASES, check_lora_backend
        report = check_lora_backend("triton", device="cpu")
        print(report)
        report.raise_for_failures(min_run=3 * len(LORA_CASES["standard"]))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]


@has_triton
@pytest.mark.parametrize("backend,arch,dt", [("cuda", 90, "bf16"), ("cuda", 80, "fp32"), ("hip", "gfx942", "fp16")])
def test_triton_kernels_compile_for_gpu_targets(backend, arch, dt, monkeypatch):
    """Catches what the interpreter cannot (dot shapes, dtypes): both kernels compiled for a real target."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from radixserve_triton import ops
    from radixserve_triton.ops import lora as L

    if ops.INTERPRETED:
        pytest.skip("radixserve_triton.ops was imported in interpreter mode in this process")
    p, runs, up = f"*{dt}", dict(SegStart="*i32", SegLen="*i32", SegSlot="*i32"), dt == "fp32"
    specs = [
        (
            L._lora_shrink_kernel,
            dict(X=p, A=p, S="*fp32", **runs),
            dict(BLOCK_T=16, BLOCK_K=32, BLOCK_IN=64, UPCAST=up),
        ),
        (
            L._lora_expand_kernel,
            dict(S="*fp32", B=p, Out=p, **runs),
            dict(BLOCK_T=64, BLOCK_N=64, BLOCK_K=64, UPCAST=up, RNE_BF16=False),
        ),
    ]
    target = GPUTarget(backend, arch, 32 if backend == "cuda" else 64)
    for fn, types, constexprs in specs:
        signature = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
        try:
            asm = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs), target=target).asm
        except RuntimeError as exc:  # a toolchain missing from this triton build, not a kernel bug
            if "ptxas" in str(exc) or "lld" in str(exc):
                pytest.skip(f"{backend} toolchain unavailable: {exc}")
            raise
        assert ("cubin" if backend == "cuda" else "hsaco") in asm, fn.fn.__name__


def test_registered_and_ordered(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    registry = PluginRegistry()
    assert {"torch_native", "torch_grouped", "triton"} <= set(registry.candidates["lora"])
    query = KernelQuery(device="cpu", dtype=torch.bfloat16, max_lora_rank=16)
    order = ["torch_grouped", "torch_native"]
    if not cpu_kernels.unavailable_reasons():
        order.insert(0, "cpu_sgmv")
    assert [c.name for c in registry.usable("lora", query)][: len(order)] == order
    cpu_sgmv = registry.candidates["lora"]["cpu_sgmv"].cls
    assert "a CPU kernel; device is cuda" in cpu_sgmv.unsupported_reasons(replace(query, device="cuda"))
    if importlib.util.find_spec("triton") is not None:
        triton_lora = registry.candidates["lora"]["triton"].cls
        assert "TRITON_INTERPRET=1" in triton_lora.unsupported_reasons(query)[0]
        assert triton_lora.unsupported_reasons(KernelQuery(device="cuda", dtype=torch.float16, max_lora_rank=8)) == []
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert triton_lora.unsupported_reasons(query) == []


# --------------------------------------------------------------------------
# Wrong backends fail, naming the cases


def _update(shrink, b_slot, splits):
    """Each projection's rank columns of ``shrink`` through its rows of ``b_slot``, concatenated."""
    rank, parts, start = b_slot.shape[-1], [], 0
    for j, size in enumerate(splits):
        parts.append(shrink[..., j * rank : (j + 1) * rank] @ b_slot[..., start : start + size, :].transpose(-1, -2))
        start += size
    return torch.cat(parts, dim=-1)


class IgnoresSlot(TorchNativeLoRA):
    """Every run uses the first run's adapter."""

    name = "ignores_slot"

    def apply(self, x, out, a, b, batch, out_splits):
        for seg in batch.segments:
            rows, slot = slice(seg.start, seg.start + seg.length), batch.segments[0].slot
            out[rows] += _update(x[rows] @ a[slot].T, b[slot], out_splits)


class TouchesBaseRows(TorchNativeLoRA):
    """Gives the base model's tokens slot 0's update too."""

    name = "touches_base_rows"

    def apply(self, x, out, a, b, batch, out_splits):
        slots = batch.token_slot.clamp(min=0).long()
        shrink = torch.einsum("ti,tki->tk", x, a[slots])
        out += _update(shrink[:, None, :], b[slots], out_splits)[:, 0]


class DropsLastToken(TorchNativeLoRA):
    """Stops one token short of each run."""

    name = "drops_last_token"

    def apply(self, x, out, a, b, batch, out_splits):
        for seg in batch.segments:
            rows = slice(seg.start, seg.start + seg.length - 1)
            out[rows] += _update(x[rows] @ a[seg.slot].T, b[seg.slot], out_splits)


class IgnoresSplits(TorchNativeLoRA):
    """Applies every projection's rank columns to all of the output rows (ignores ``out_splits``)."""

    name = "ignores_splits"

    def apply(self, x, out, a, b, batch, out_splits):
        rank = b.shape[2]
        for seg in batch.segments:
            rows = slice(seg.start, seg.start + seg.length)
            shrink = x[rows] @ a[seg.slot].T
            out[rows] += sum(shrink[:, j * rank : (j + 1) * rank] @ b[seg.slot].T for j in range(len(out_splits)))


class EqualSplits(TorchNativeLoRA):
    """Takes the fused projections as equal in size (right for gate/up, wrong for q/k/v)."""

    name = "equal_splits"

    def apply(self, x, out, a, b, batch, out_splits):
        n, total = len(out_splits), out.shape[1]
        equal = (total // n,) * (n - 1) + (total - total // n * (n - 1),)
        super().apply(x, out, a, b, batch, equal)


def _failing(backend) -> dict[str, str]:
    report = check_lora_backend(backend, dtypes=[torch.float32])
    assert not report.ok
    with pytest.raises(AssertionError, match=backend.name):
        report.raise_for_failures()
    return {r.case: r.error or "" for r in report.failures}


def test_kit_fails_a_backend_that_ignores_the_slot():
    failing = _failing(IgnoresSlot)
    multi_slot = {c.name for c in LORA_CASES["standard"] if len(set(c.request_slots) - {N}) > 1}
    assert set(failing) == multi_slot


def test_kit_fails_a_backend_that_touches_base_rows():
    failing = _failing(TouchesBaseRows)
    with_base = {c.name for c in LORA_CASES["standard"] if c.num_tokens and N in c.request_slots}
    assert with_base <= set(failing)
    assert all("base-model rows changed" in failing[name] for name in with_base)


def test_kit_fails_a_backend_that_drops_a_token():
    failing = _failing(DropsLastToken)
    with_tokens = {c.name for c in LORA_CASES["standard"] if set(c.request_slots) - {N}}
    assert set(failing) == with_tokens


def test_kit_fails_a_backend_that_ignores_out_splits():
    failing = _failing(IgnoresSplits)
    fused = {c.name for c in LORA_CASES["standard"] if c.fused > 1 and set(c.request_slots) - {N}}
    assert fused and set(failing) == fused


def test_kit_fails_a_backend_that_takes_qkv_splits_as_equal():
    failing = _failing(EqualSplits)
    qkv = {c.name for c in LORA_CASES["standard"] if c.fused == 3 and set(c.request_slots) - {N}}
    assert qkv and set(failing) == qkv


def test_grouped_and_native_agree_on_a_large_interleaved_batch():
    # many runs of each slot: torch_grouped gathers (index_add_), torch_native loops
    case = LoRACase("big", (1,) * 40 + (9, 1), tuple(i % 5 for i in range(40)) + (N, 2), 96, 80, 8, 5, fused=3)
    report = check_lora_backend(TorchGroupedLoRA, dtypes=[torch.float32], cases=[case])
    report.raise_for_failures(min_run=1)


# --------------------------------------------------------------------------
# auto's timing cases


SHAPES = ModelShapes(
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=128,
    decode_rows=6,
    prefill_rows=10,
    decode_context=32,
    lora_slots=3,
)


class RecordsArguments(TorchNativeLoRA):
    def apply(self, *arguments):
        self.arguments = arguments


def test_timing_cases_run_on_the_torch_backends():
    query = KernelQuery(device="cpu", dtype=torch.bfloat16, max_lora_rank=8)
    cases = timing_cases("lora", query, SHAPES, CPU)
    assert [c.label for c in cases] == [
        f"{proj}/{phase}/m{rows}"
        for proj in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        for phase, rows in (("single", 1), ("decode", 6), ("prefill", 10))
    ]
    splits = {"qkv_proj": (64, 32, 32), "o_proj": (64,), "gate_up_proj": (96, 96), "down_proj": (64,)}
    for case in cases:
        recorder = RecordsArguments(query)
        case.setup(recorder)()
        _, out, a, b, _, out_splits = recorder.arguments
        expected = splits[case.label.split("/")[0]]
        assert out_splits == expected and out.shape[1] == sum(expected)
        assert a.shape[1] == 8 * len(expected) and b.shape[1:] == (sum(expected), 8)
    backends = [TorchNativeLoRA(query), TorchGroupedLoRA(query)]
    if not cpu_kernels.unavailable_reasons():
        backends.append(CpuSgmvLoRA(query))
    for backend in backends:
        for case in cases:
            call = case.setup(backend)
            for _ in range(3):
                call()


def test_serving_adapters_keeps_the_other_kinds_cached_timings(tmp_path):
    selection = MeasuredSelection(PluginRegistry(), CpuPlatform(), 0, SHAPES, cache=TimingCache(tmp_path))
    plain = KernelQuery(device="cpu", dtype=torch.bfloat16)
    with_lora = KernelQuery(device="cpu", dtype=torch.bfloat16, max_lora_rank=8)
    assert selection._key("gemm", plain, []) == selection._key("gemm", with_lora, [])
    assert selection._key("lora", with_lora, []) != selection._key("lora", replace(with_lora, max_lora_rank=16), [])
