"""The ``elementwise`` kernel kind: RMSNorm with the residual fused in, rotary in
place, SiLU-and-mul. The torch reference computes exactly what HuggingFace's
modeling code does (bit for bit, in bfloat16 too), the conformance kit passes it
and the Triton kernels (interpreter), and fails loudly on wrong backends;
selection, the flag and the start-up check know the kind."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers_platform import needs_platform

from radixserve.config import ServerArgs
from radixserve.kernels import MODEL_SPECIFIC_OPS, KernelQuery
from radixserve.layers.rotary import rope_cos_sin_cache
from radixserve.registry import PluginError, PluginRegistry
from radixserve.startup_checks import check_startup
from radixserve.startup_error import StartupError
from radixserve.testing import ELEMENTWISE_CASES, check_elementwise_backend
from radixserve_torch.elementwise import TorchNativeElementwise

QUERY = KernelQuery(device="cpu", dtype=torch.bfloat16, head_dim=128)


# --------------------------------------------------------------------------
# The reference is HuggingFace's arithmetic


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_reference_is_bitwise_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    ops = TorchNativeElementwise(KernelQuery(device="cpu", dtype=dtype))
    x, residual = (torch.randn((9, 96), generator=gen) * 3).to(dtype), torch.randn((9, 96), generator=gen).to(dtype)
    hf_norm = LlamaRMSNorm(96, eps=1e-6).to(dtype)
    hf_norm.weight.data = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    expected_residual = residual + x
    expected = hf_norm(expected_residual)
    out, new_residual = ops.rms_norm(x.clone(), hf_norm.weight.data, 1e-6, residual.clone())
    assert torch.equal(out, expected) and torch.equal(new_residual, expected_residual)
    assert torch.equal(ops.rms_norm(x, hf_norm.weight.data, 1e-6), hf_norm(x))

    positions = torch.tensor([0, 3, 3, 700, 41])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    table = rope_cos_sin_cache(inv_freq, 1.0, 1024, dtype)
    cos, sin = table[positions].chunk(2, dim=-1)
    qkv = torch.randn((5, (4 + 2 + 2) * 64), generator=gen).to(dtype)
    v_before = qkv[:, 6 * 64 :].clone()
    fused = (qkv[:, : 4 * 64].view(5, 4, 64), qkv[:, 4 * 64 : 6 * 64].view(5, 2, 64))  # as the models pass them
    separate = (fused[0].clone(), fused[1].clone())
    ref_q, ref_k = apply_rotary_pos_emb(
        *separate, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), unsqueeze_dim=1
    )
    for q, k in (fused, separate):
        ops.apply_rotary(q, k, positions, table, neox_style=True)
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(qkv[:, 6 * 64 :], v_before)

    gate_up = torch.randn((3, 2 * 40), generator=gen).to(dtype)
    assert torch.equal(ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:])


# --------------------------------------------------------------------------
# The kit


def test_torch_reference_passes_the_kit_and_the_cases_cover_the_contract():
    report = check_elementwise_backend("torch_native").raise_for_failures()
    assert {r.dtype for r in report.results} == {"float32", "bfloat16", "float16"}
    cases = ELEMENTWISE_CASES["standard"]
    assert len(report.results) == 3 * len(cases)
    norms = [c for c in cases if c.op == "rms_norm"]
    ropes = [c for c in cases if c.op == "rotary"]
    assert {c.residual for c in norms} == {True, False} and any(c.heads for c in norms)
    assert min(c.hidden for c in norms) == 64 and max(c.hidden for c in norms) >= 4096
    assert any(c.hidden % 2 for c in norms)  # odd sizes
    assert {c.head_dim for c in ropes} == {64, 128} and {c.neox_style for c in ropes} == {True, False}
    assert any(c.rot_dim < c.head_dim for c in ropes) and any(c.strided for c in ropes)
    assert {min(c.num_tokens for c in cases), max(c.num_tokens for c in cases)} == {1, 300}


class NoResidualAdd(TorchNativeElementwise):
    """Normalises x but forgets to add the residual."""

    name = "no_residual_add"

    def rms_norm(self, x, weight, eps, residual=None):
        out = super().rms_norm(x, weight, eps)
        return out if residual is None else (out, residual)


class SwappedRotaryPairs(TorchNativeElementwise):
    """Pairs dims the other way (GPT-J for NeoX and back)."""

    name = "swapped_pairs"

    def apply_rotary(self, q, k, positions, cos_sin_cache, neox_style=True):
        super().apply_rotary(q, k, positions, cos_sin_cache, not neox_style)


class RotatesEveryDim(TorchNativeElementwise):
    """Ignores partial rotary: rotates all of head_dim with a widened table."""

    name = "rotates_every_dim"

    def apply_rotary(self, q, k, positions, cos_sin_cache, neox_style=True):
        cos, sin = cos_sin_cache.chunk(2, dim=-1)
        reps = q.shape[-1] // cos_sin_cache.shape[-1]
        super().apply_rotary(q, k, positions, torch.cat((cos.repeat(1, reps), sin.repeat(1, reps)), -1), neox_style)


class NormInPlace(TorchNativeElementwise):
    """Writes the norm over its input when there is no residual."""

    name = "norm_in_place"

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is None:
            return x.copy_(super().rms_norm(x, weight, eps))
        return super().rms_norm(x, weight, eps, residual)


class SwappedGateUp(TorchNativeElementwise):
    name = "swapped_gate_up"

    def silu_and_mul(self, x):
        return super().silu_and_mul(torch.cat(x.chunk(2, dim=-1)[::-1], dim=-1))


class MaskBitsHighFirst(TorchNativeElementwise):
    """Reads each bitmask word from its highest bit: token 32w + b from bit 31 - b."""

    name = "mask_bits_high_first"

    def apply_token_bitmask(self, logits, bitmask, rows):
        shifts = 31 - torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)[:, : logits.shape[-1]]
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class MaskIgnoresRows(TorchNativeElementwise):
    """Masks logits row i with bitmask row i, whatever ``rows`` says."""

    name = "mask_ignores_rows"

    def apply_token_bitmask(self, logits, bitmask, rows):
        super().apply_token_bitmask(logits, bitmask, torch.arange(len(rows)))


@pytest.mark.parametrize(
    "backend,failing,message",
    [
        (NoResidualAdd, "rms_norm/residual/", None),
        (SwappedRotaryPairs, "rotary/", None),
        (RotatesEveryDim, "partial", None),
        (NormInPlace, "rms_norm/(T|per-head)", "modified its input"),
        (SwappedGateUp, "silu_and_mul/", None),
        (MaskBitsHighFirst, "apply_token_bitmask/", None),
        (MaskIgnoresRows, "apply_token_bitmask/", None),
    ],
    ids=lambda v: getattr(v, "name", None),
)
def test_wrong_backends_fail_naming_the_cases(backend, failing, message):
    report = check_elementwise_backend(backend, dtypes=[torch.float32], cases="quick")
    assert not report.ok
    failed = [r.case for r in report.failures]
    assert failed and all(re.search(failing, name) for name in failed), failed
    with pytest.raises(AssertionError, match=failed[0].replace("/", ".")):
        report.raise_for_failures()
    if message:
        assert all(message in (r.error or "") for r in report.failures)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_passes_the_kit_in_the_interpreter():
    """Every op on the quick cases, all dtypes, Gemma's too (a subprocess:
    TRITON_INTERPRET is read when the kernels are defined)."""
    code = textwrap.dedent("""
        from radixserve.testing import check_elementwise_backend
        report = check_elementwise_backend("triton", device="cpu", cases="quick")
        print(report)
        report.raise_for_failures()
        assert {r.dtype for r in report.results} == {"float32", "bfloat16", "float16"}
        assert len(report.results) == 39
        assert {"gemma_rms_norm", "gelu_tanh_and_mul"} <= {r.case.split("/")[0] for r in report.results}
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]


# --------------------------------------------------------------------------
# Selection, the flag, start-up


def test_selection_and_report(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    registry = PluginRegistry()
    assert registry.select("elementwise", QUERY).name == "cpu_fused"  # the C++ ops (conftest built them)
    rows = {row["name"]: row for row in registry.report()["backends"]["elementwise"]}
    assert rows["torch_native"]["usable"] and rows["torch_native"]["plugin"] == "torch"
    assert rows["cpu_fused"]["usable"] and rows["cpu_fused"]["plugin"] == "torch"
    if importlib.util.find_spec("triton") is not None:
        assert not rows["triton"]["usable"] and "TRITON_INTERPRET=1" in rows["triton"]["reasons"][0]
        with pytest.raises(PluginError, match="TRITON_INTERPRET=1"):
            registry.select("elementwise", QUERY, "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the opt-in: triton outranks the reference
        assert registry.select("elementwise", QUERY).name == "triton"
        for device in ("cuda", "rocm"):
            assert registry.select("elementwise", KernelQuery(device=device, dtype=torch.bfloat16)).name == "triton"


def test_flag_and_unknown_backend_at_startup():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--elementwise-backend", "torch_native"]))
    assert args.elementwise_backend == "torch_native"
    check_startup(ServerArgs(device="cpu", elementwise_backend="torch_native"))
    with pytest.raises(StartupError, match="--elementwise-backend 'nope' is not a registered elementwise backend"):
        check_startup(ServerArgs(device="cpu", elementwise_backend="nope"))


@pytest.mark.cuda
@needs_platform("cuda")
@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_elementwise_kit_on_cuda(backend):
    """On an NVIDIA GPU (scripts/gpu_check.sh): the full case set, up to 4096 tokens."""
    report = check_elementwise_backend(backend, device="cuda", cases="full")
    print(report)
    # triton has no model-specific ops (Gemma's) and skips their cases
    cases = [c for c in ELEMENTWISE_CASES["full"] if backend == "torch_native" or c.op not in MODEL_SPECIFIC_OPS]
    report.raise_for_failures(min_run=3 * len(cases))
