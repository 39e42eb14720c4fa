"""The multi-head latent attention kit: torch_mla (up-projected extend, absorbed
decode) passes it and agrees with the kit's independent dense float64 math, and
deliberately wrong MLA backends fail it, naming the cases; triton_mla passes it
in Triton's interpreter and its decode kernel compiles for GPU targets; auto
times the usable MLA backends on latent-pool steps."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from radixserve.backend_timing import MeasuredSelection, ModelShapes, TimingCache
from radixserve.hooks import hookimpl
from radixserve.registry import PluginRegistry
from radixserve.testing import MLA_CASES, check_mla_attention_backend, dense_mla_attention, make_mla_inputs
from radixserve_torch.attention_mla import TorchMLAAttention
from radixserve_torch.platform import CpuPlatform


def test_torch_mla_passes_the_kit():
    report = check_mla_attention_backend("torch_mla")
    report.raise_for_failures(min_run=3 * len(MLA_CASES["standard"]))
    assert {r.dtype for r in report.results} == {"float32", "bfloat16", "float16"}
    assert all(r.kv_store == "ok" for r in report.results)
    cases = MLA_CASES["standard"]
    assert {c.mode for c in cases} == {"extend", "decode"} and {c.page_size for c in cases} == {1, 16}
    assert any(c.mode == "extend" and any(c.prefix_lens) for c in cases)  # prefix hits
    assert any(c.kv_lora_rank == 512 and c.qk_rope_head_dim == 64 for c in cases)  # V2-Lite's head shape


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("case", MLA_CASES["standard"], ids=lambda c: c.name)
def test_torch_mla_matches_independent_dense_math(case, layout):
    """torch_mla against the kit's float64 up-projected attention from the unpaged
    entries: decode (absorbed) and extend (up-projected) alike."""
    inputs = make_mla_inputs(case, torch.float32, layout=layout, seed=11)
    backend = TorchMLAAttention(case.query("cpu", torch.float32))
    backend.init_forward_metadata(inputs.batch)
    out = backend.forward_mla(
        inputs.q_nope, inputs.q_rope, inputs.latent, inputs.k_rope, inputs.kv_b_weight, inputs.layer, inputs.batch
    )
    assert out.shape == (sum(case.extend_lens), case.num_heads, case.v_head_dim)
    assert (out.double() - dense_mla_attention(inputs)).abs().max().item() < 5e-6


class DecodeWithoutRope(TorchMLAAttention):
    """Leaves the rotary part out of the decode scores."""

    name = "decode_without_rope"

    def forward_mla_decode(self, q_nope, q_rope, kv_b_weight, layer, batch):
        return super().forward_mla_decode(q_nope, torch.zeros_like(q_rope), kv_b_weight, layer, batch)


class StoresIntoLayerZero(TorchMLAAttention):
    name = "mla_wrong_layer_store"

    def store_latent(self, latent, k_rope, layer, batch):
        super().store_latent(latent, k_rope, dataclasses.replace(layer, layer_id=0), batch)


def test_wrong_mla_backends_fail_naming_the_cases():
    report = check_mla_attention_backend(DecodeWithoutRope, dtypes=[torch.float32])
    decode = {c.name for c in MLA_CASES["standard"] if c.mode == "decode"}
    assert {r.case for r in report.failures} == decode
    with pytest.raises(AssertionError, match="decode/p16/h16/v2-lite"):
        report.raise_for_failures()

    report = check_mla_attention_backend(StoresIntoLayerZero, dtypes=[torch.float32], cases="quick")
    assert len(report.failures) == len(MLA_CASES["quick"])
    for r in report.results:
        assert "layer 0 latent" in r.kv_store and "other slots modified" in r.kv_store
        assert "new slots not stored correctly" in r.kv_store


# --------------------------------------------------------------------------
# triton_mla: the kit in Triton's interpreter (a subprocess: TRITON_INTERPRET is
# read when the kernels are defined), and its kernel compiled for GPU targets


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_mla_passes_the_kit_in_the_interpreter():
    code = textwrap.dedent("""
        import torch
        from radixserve.testing import MLA_CASES, MLACase, check_mla_attention_backend, dense_mla_attention
        from radixserve.testing import make_mla_inputs
        from radixserve_triton.ops.mla import mla_decode_attention

        report = check_mla_attention_backend("triton_mla", device="cpu")
        print(report)
        report.raise_for_failures(min_run=3 * len(MLA_CASES["standard"]))
        # The kit's sequences are too short to split; split-KV decode, splits left empty included:
        case = MLACase("decode/splits", "decode", 16, 20, 64, 32, 16, 48, (0, 2, 150, 37), (1, 1, 1, 1))
        inputs = make_mla_inputs(case, torch.float32, seed=3)
        pool = inputs.batch.kv_pool
        pool.set_latent(case.layer_id, inputs.batch.out_cache_loc, inputs.latent, inputs.k_rope)
        w_uk, w_uv = inputs.kv_b_weight[:, :32], inputs.kv_b_weight[:, 32:]
        q_latent = torch.einsum("thn,hnl->thl", inputs.q_nope, w_uk)
        for splits in (1, 3, 8):
            out = mla_decode_attention(
                q_latent, inputs.q_rope, pool.get_latent(case.layer_id), inputs.batch.req_to_token,
                inputs.batch.req_pool_indices, inputs.batch.seq_lens, case.softmax_scale, num_kv_splits=splits,
            )
            out = torch.einsum("thl,hvl->thv", out, w_uv)
            err = (out.double() - dense_mla_attention(inputs)).abs().max().item()
            assert err < 1e-5, (splits, err)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("backend,arch,dt", [("cuda", 90, "bf16"), ("cuda", 80, "fp32"), ("hip", "gfx942", "fp16")])
def test_triton_mla_kernel_compiles_for_gpu_targets(backend, arch, dt, monkeypatch):
    """V2-Lite's shape (kv_lora_rank 512, rope 64) compiled to device code: the
    errors the interpreter cannot catch (dot shapes, layouts, registers)."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    from test_triton_backends import _compile
    from triton.backends.compiler import GPUTarget

    from radixserve_triton import ops
    from radixserve_triton.ops.mla import BLOCK_HEADS, _mla_decode_partial_kernel

    if ops.INTERPRETED:
        pytest.skip("radixserve_triton.ops was imported in interpreter mode in this process")
    p, i64, f32 = f"*{dt}", "*i64", "*fp32"
    types = dict(
        QLatent=p, QRope=p, Entries=p, ReqToToken=i64, ReqPoolIdx=i64, SeqLens=i64, PartialO=f32, PartialLse=f32
    )
    types["qk_scale"] = "fp32"
    constexprs = dict(
        NUM_HEADS=16,
        RANK=512,
        ROPE=64,
        BLOCK_H=BLOCK_HEADS,
        BLOCK_L=512,
        BLOCK_R=64,
        BLOCK_N=32,
        NUM_SPLITS=4,
        UPCAST=dt == "fp32",
        RNE_BF16=False,
    )
    target = GPUTarget(backend, arch, 32 if backend == "cuda" else 64)
    try:
        asm = _compile(_mla_decode_partial_kernel, types, constexprs, target)
    except RuntimeError as exc:  # a toolchain missing from this triton build, not a kernel bug
        if "ptxas" in str(exc) or "lld" in str(exc):
            pytest.skip(f"{backend} toolchain unavailable: {exc}")
        raise
    assert ("cubin" if backend == "cuda" else "hsaco") in asm


# --------------------------------------------------------------------------
# auto times the usable MLA backends on MLA steps


class SlowMLA(TorchMLAAttention):
    """torch_mla with a 20 ms wait per call, and first by priority."""

    name = "slow_mla"
    priority = 100

    def forward_mla(self, *args):
        time.sleep(0.02)
        return super().forward_mla(*args)


def test_auto_times_mla_backends_on_latent_steps(tmp_path):
    class Plugin:
        @hookimpl
        def register_attention_backends(self, register):
            register(SlowMLA)
            register(TorchMLAAttention)

    registry = PluginRegistry(load_entry_points=False)
    registry.register_plugin(Plugin(), "mla")
    query = MLA_CASES["quick"][0].query("cpu", torch.float32)
    shapes = ModelShapes(
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=4,
        head_dim=48,
        vocab_size=256,
        decode_rows=4,
        prefill_rows=32,
        decode_context=64,
    )
    chooser = MeasuredSelection(registry, CpuPlatform(), 0, shapes, cache=TimingCache(tmp_path))
    assert chooser.select("attention", query) is TorchMLAAttention
    choice = chooser.choices["attention"]
    assert (
        set(choice.seconds["slow_mla"])
        == set(choice.seconds["torch_mla"])
        == {
            "decode/bs1/ctx64",
            "decode/bs4/ctx64",
            "extend/t32",
        }
    )
    assert choice.scores["torch_mla"] == 1.0 and min(choice.seconds["slow_mla"].values()) >= 0.02
