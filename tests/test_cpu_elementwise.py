"""cpu_fused: RMSNorm (with the fused residual add), SiLU-and-mul and rotary as
C++ ops (csrc/cpu_elementwise.cpp); the cpu default elementwise backend.

The conformance kit against torch_native for every dtype and case set; the ops
round where HuggingFace rounds, so they agree with the reference to float32's
last bit or, rarely, one unit of bfloat16 (rotary: exactly, but for float32's
last bit); the layouts the C++ ops do not take run the reference's code; whole
greedy generations equal torch_native's."""

from __future__ import annotations

import pytest
import torch
from generation_utils import generate, make_scheduler, mixed_prompts

from radixserve.kernels import KernelQuery
from radixserve.layers.rotary import rope_cos_sin_cache
from radixserve.testing import check_elementwise_backend
from radixserve_torch.elementwise import TorchNativeElementwise
from radixserve_torch.elementwise_cpu import CpuFusedElementwise


@pytest.mark.parametrize("cases", ["standard", "full"])
def test_conformance_kit_passes_for_every_dtype(cases):
    report = check_elementwise_backend("cpu_fused", device="cpu", cases=cases)
    print(report)
    report.raise_for_failures()
    assert {r.dtype for r in report.results} == {"float32", "bfloat16", "float16"}
    assert not report.skipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_agrees_with_the_reference_on_model_shapes(dtype):
    gen = torch.Generator().manual_seed(1)
    query = KernelQuery(device="cpu", dtype=dtype)
    fused, ref = CpuFusedElementwise(query), TorchNativeElementwise(query)
    x = (torch.randn((300, 1024), generator=gen) * 2).to(dtype)
    residual = torch.randn((300, 1024), generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(1024, generator=gen)).to(dtype)
    out, res = fused.rms_norm(x.clone(), weight, 1e-6, residual.clone())
    want, want_res = ref.rms_norm(x.clone(), weight, 1e-6, residual.clone())
    assert torch.equal(res, want_res)  # the residual sum rounds exactly as the reference
    # One unit of the model dtype in the normalised value, re-rounded by the weight's product.
    ulp = 1e-6 if dtype == torch.float32 else 2**-7
    assert ((out.float() - want.float()).abs() <= 2 * ulp * want.float().abs() + 1e-30).all()
    assert (out != want).float().mean() < (1e-3 if dtype == torch.bfloat16 else 0.5)
    gate_up = (torch.randn((300, 2 * 2816), generator=gen) * 4).to(dtype)
    got, want = fused.silu_and_mul(gate_up), ref.silu_and_mul(gate_up)
    assert ((got.float() - want.float()).abs() <= 2 * ulp * want.float().abs() + 1e-30).all()
    assert (got != want).float().mean() < (1e-3 if dtype == torch.bfloat16 else 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("neox_style", [True, False])
@pytest.mark.parametrize("rotary_dim", [128, 64])
def test_rotary_rounds_as_the_reference(dtype, neox_style, rotary_dim):
    query = KernelQuery(device="cpu", dtype=dtype)
    fused, ref = CpuFusedElementwise(query), TorchNativeElementwise(query)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    cache = rope_cos_sin_cache(inv_freq, 1.0, 4096, dtype)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn((37, 12 * 128), generator=gen).to(dtype)  # 8 q heads, 2 k heads, 2 v heads
    positions = torch.randint(0, 4096, (37,), generator=gen)
    turned = []
    for backend in (fused, ref):
        x = qkv.clone()
        backend.apply_rotary(
            x[:, :1024].view(37, 8, 128), x[:, 1024:1280].view(37, 2, 128), positions, cache, neox_style
        )
        turned.append(x)
    assert torch.equal(turned[0][:, 1280:], qkv[:, 1280:])  # v untouched
    if dtype == torch.float32:  # the compiler may fuse a product into the sum
        torch.testing.assert_close(turned[0], turned[1], rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(turned[0], turned[1])


def test_views_the_ops_do_not_take_run_the_reference():
    query = KernelQuery(device="cpu", dtype=torch.float32)
    fused, ref = CpuFusedElementwise(query), TorchNativeElementwise(query)
    x = torch.randn(4, 6, 5, 32)[:, ::2]  # 4-D with two strided leading dims: no [A, B, H] view
    weight = torch.randn(32)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
    residual_base = torch.randn(6, 64)
    x2, residual = torch.randn(3, 64), residual_base[::2]  # a strided residual
    want = ref.rms_norm(x2.clone(), weight.repeat(2), 1e-5, residual.clone())
    got = fused.rms_norm(x2.clone(), weight.repeat(2), 1e-5, residual.clone())
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_generation_matches_torch_native(tiny_llama_dir):
    prompts = mixed_prompts(512, [5, 60, 17, 33], seed=8, shared_prefix=20)
    outputs = {}
    for backend in ("torch_native", "cpu_fused"):
        scheduler = make_scheduler(tiny_llama_dir, elementwise_backend=backend)
        assert scheduler.runner.summary()["backends"]["elementwise"] == backend
        outputs[backend] = [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=24, ignore_eos=True)]
    assert outputs["cpu_fused"] == outputs["torch_native"]
