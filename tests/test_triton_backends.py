"""The triton plugin: selection (cheap, no triton import), kernels in the Triton
interpreter, and compilation of every kernel for real GPU targets (no GPU needed).

Triton decides when a kernel is *defined* whether it runs in the CPU interpreter
(``TRITON_INTERPRET=1``), and a set variable makes ``auto`` pick triton on cpu,
so the interpreter tests (``test_interp_*``) run in a subprocess:
``test_kernels_in_interpreter`` re-runs this file there with the variable set.
Run them directly with ``TRITON_INTERPRET=1 pytest tests/test_triton_backends.py``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from radixserve.kernels import KernelQuery, MoERouting, route
from radixserve.registry import PluginError, PluginRegistry
from radixserve_triton import TritonAttention, TritonMoE

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter subprocess (test_kernels_in_interpreter)")
has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

ATTN_QUERY = KernelQuery(device="cpu", dtype=torch.bfloat16, head_dim=128, num_heads=8, num_kv_heads=2, page_size=16)
MOE_QUERY = KernelQuery(device="cpu", dtype=torch.bfloat16, num_experts=8, top_k=2)


# --------------------------------------------------------------------------
# Selection: cheap and side-effect free


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@has_triton
def test_cpu_needs_the_interpreter_opt_in(no_interpreter, monkeypatch):
    for cls, query in ((TritonAttention, ATTN_QUERY), (TritonMoE, MOE_QUERY)):
        reasons = cls.unsupported_reasons(query)
        assert len(reasons) == 1 and "cuda or rocm" in reasons[0] and "TRITON_INTERPRET=1" in reasons[0]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttention.unsupported_reasons(ATTN_QUERY) == []
    assert TritonMoE.unsupported_reasons(MOE_QUERY) == []


@has_triton
def test_gpu_devices_and_limits(no_interpreter):
    for device in ("cuda", "rocm"):
        q = KernelQuery(device=device, dtype=torch.float16, head_dim=64, num_heads=4, num_kv_heads=4)
        assert TritonAttention.unsupported_reasons(q) == []
        assert TritonMoE.unsupported_reasons(KernelQuery(device=device, dtype=torch.float32)) == []
    assert "npu" in TritonAttention.unsupported_reasons(KernelQuery(device="npu", dtype=torch.float16))[0]
    bad = TritonAttention.unsupported_reasons(
        KernelQuery(device="cuda", dtype=torch.int8, head_dim=512, num_heads=6, num_kv_heads=4, kv_dtype=torch.int8)
    )
    text = "; ".join(bad)
    assert "dtype torch.int8" in text and "KV cache dtype" in text and "head_dim 512" in text and "multiple" in text
    moe = TritonMoE.unsupported_reasons(
        KernelQuery(device="cuda", dtype=torch.float16, num_experts=4, top_k=5, quantization="int8")
    )
    assert any("top_k 5" in r for r in moe) and any("quantized" in r for r in moe)


def test_reasons_when_triton_is_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert "not installed" in TritonAttention.unsupported_reasons(KernelQuery(device="cuda", dtype=torch.float16))[0]


def test_probing_never_imports_triton():
    code = textwrap.dedent("""
        import sys, torch
        from radixserve.registry import PluginRegistry
        from radixserve.kernels import KernelQuery
        reg = PluginRegistry()
        q = KernelQuery(device="cuda", dtype=torch.float16, head_dim=64, num_heads=4, num_kv_heads=4)
        print(reg.candidates["attention"]["triton"].cls.unsupported_reasons(q))
        reg.report()
        assert "triton" not in sys.modules, "selection imported triton"
        assert "radixserve_triton.ops" not in sys.modules
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_registered_through_entry_point_and_selection(no_interpreter, monkeypatch):
    registry = PluginRegistry()
    assert registry.candidates["attention"]["triton"].cls is TritonAttention
    info = registry.plugins["triton"]
    assert info.error is None and info.distribution == "radixserve"
    assert info.registered == {
        "attention": ["triton", "triton_mla"],
        "moe": ["triton"],
        "lora": ["triton"],
        "elementwise": ["triton"],
    }
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    # cpu without the opt-in: auto takes cpu_paged (torch's fast path), forcing triton says why not
    assert registry.select("attention", ATTN_QUERY).name == "cpu_paged"
    assert registry.select("moe", MOE_QUERY).name == "torch_native"
    with pytest.raises(PluginError, match="TRITON_INTERPRET=1"):
        registry.select("attention", ATTN_QUERY, "triton")
    # opted in: triton outranks the torch backends (selection alone imports nothing)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.select("attention", ATTN_QUERY) is TritonAttention
    assert registry.select("moe", MOE_QUERY) is TritonMoE


# --------------------------------------------------------------------------
# Kernels in the interpreter (subprocess)


@has_triton
@pytest.mark.skipif(INTERPRETED, reason="already in the interpreter")
def test_kernels_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interp_"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def _attention_inputs(case, dtype, seed):
    from radixserve.testing import make_attention_inputs

    return make_attention_inputs(case, dtype, "cpu", seed=seed)


@interp
def test_interp_kernels_were_built_for_the_interpreter():
    from radixserve_triton import ops

    assert ops.INTERPRETED


@interp
@pytest.mark.parametrize("window,cap", [(None, None), (40, None), (40, 3.0)])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_interp_decode_split_kv(splits, window, cap):
    """Split-KV decode, including splits left empty by short sequences; with a
    window the splits cut only the window's keys."""
    from radixserve.testing import AttentionCase, dense_attention
    from radixserve_triton.ops import attention as attn_ops

    case = AttentionCase(
        "decode", "decode", 16, 8, 2, 64, (0, 2, 150, 37), (1, 1, 1, 1), sliding_window=window, logit_softcap=cap
    )
    inputs = _attention_inputs(case, torch.float32, seed=3)
    k_cache, v_cache = inputs.batch.kv_pool.get_kv(case.layer_id)
    attn_ops.store_kv(inputs.k, inputs.v, k_cache, v_cache, inputs.batch.out_cache_loc)
    out = attn_ops.decode_attention(
        inputs.q,
        k_cache,
        v_cache,
        inputs.batch.req_to_token,
        inputs.batch.req_pool_indices,
        inputs.batch.seq_lens,
        case.softmax_scale,
        num_kv_splits=splits,
        sliding_window=window,
        logit_softcap=cap,
    )
    assert (out.double() - dense_attention(inputs)).abs().max().item() < 1e-5


@interp
def test_interp_split_heuristic():
    from radixserve_triton.ops.attention import choose_num_kv_splits

    assert choose_num_kv_splits(1, 1, 4096) == 16
    assert choose_num_kv_splits(64, 8, 4096) == 1
    assert choose_num_kv_splits(1, 1, 5) == 1


@interp
def test_interp_strided_qkv_views():
    """q/k/v as views into one fused qkv projection (rows not contiguous)."""
    from radixserve.testing import AttentionCase, dense_attention

    case = AttentionCase("extend", "extend", 1, 4, 2, 64, (5, 0), (7, 20))
    inputs = _attention_inputs(case, torch.float16, seed=4)
    t, h, kvh, d = inputs.q.shape[0], 4, 2, 64
    qkv = torch.cat([inputs.q.reshape(t, -1), inputs.k.reshape(t, -1), inputs.v.reshape(t, -1)], dim=1)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    assert not q.is_contiguous()
    backend = TritonAttention(case.query("cpu", torch.float16))
    backend.init_forward_metadata(inputs.batch)
    out = backend.forward(q, k, v, inputs.layer, inputs.batch)
    assert (out.double() - dense_attention(inputs)).abs().max().item() < 5e-3


@interp
def test_interp_metadata_computed_lazily_when_missing():
    from radixserve.forward_batch import ForwardMode
    from radixserve.testing import AttentionCase, dense_attention

    case = AttentionCase("decode", "decode", 1, 2, 2, 64, (4, 9), (1, 1))
    backend = TritonAttention(case.query("cpu", torch.float32))
    inputs = _attention_inputs(case, torch.float32, seed=5)
    backend.init_forward_metadata(inputs.batch)
    assert inputs.batch.attn_metadata.mode is ForwardMode.DECODE and inputs.batch.attn_metadata.max_seq_len == 10
    fresh = _attention_inputs(case, torch.float32, seed=6)  # no init_forward_metadata
    out = backend.forward(fresh.q, fresh.k, fresh.v, fresh.layer, fresh.batch)
    assert (out.double() - dense_attention(fresh)).abs().max().item() < 1e-5


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_interp_store_kv_is_exact(dtype):
    from radixserve_triton.ops.attention import store_kv

    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.zeros(40, 3, 80, dtype=dtype), torch.zeros(40, 3, 80, dtype=dtype)
    loc = torch.randperm(39, generator=gen)[:21] + 1
    k, v = torch.randn(21, 3, 80, generator=gen), torch.randn(21, 3, 80, generator=gen)  # float32 into the pool dtype
    store_kv(k, v, k_cache, v_cache, loc)
    ek, ev = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ek[loc], ev[loc] = k.to(dtype), v.to(dtype)
    assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)


@interp
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_interp_align_assignments(block_m):
    from radixserve_triton.ops.moe import align_assignments

    ids = torch.randint(0, 6, (11, 3), generator=torch.Generator().manual_seed(0))
    flat = ids.flatten()
    sorted_ids, block_expert, num_padded = align_assignments(ids, 6, block_m)
    used = int(num_padded)
    assert used % block_m == 0 and sorted_ids.numel() % block_m == 0 and used <= sorted_ids.numel()
    real = sorted_ids[:used]
    assert sorted(real[real < flat.numel()].tolist()) == list(range(flat.numel()))  # each assignment once
    for b in range(used // block_m):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        assert (flat[rows[rows < flat.numel()]] == block_expert[b]).all()
    assert (sorted_ids[used:] == flat.numel()).all()


@interp
def test_interp_moe_single_token_most_experts_idle():
    gen = torch.Generator().manual_seed(1)
    e, h, i = 16, 32, 48
    hidden, logits = torch.randn(1, h, generator=gen), torch.randn(1, e, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    routing = MoERouting(top_k=2, renormalize=True)
    out = TritonMoE(KernelQuery(device="cpu", dtype=torch.float32, num_experts=e, top_k=2)).forward(
        hidden, logits, w13, w2, routing
    )
    weights, ids = route(logits, routing)
    ref = torch.zeros(1, h)
    for slot in range(2):
        gate_up = hidden @ w13[int(ids[0, slot])].T
        act = torch.nn.functional.silu(gate_up[:, :i]) * gate_up[:, i:]
        ref += weights[0, slot] * (act @ w2[int(ids[0, slot])].T)
    assert (out - ref).abs().max().item() < 1e-5


# --------------------------------------------------------------------------
# GPU code generation without a GPU: every kernel compiles to cubin / hsaco


def _compile(fn, types: dict, constexprs: dict, target) -> dict:
    import triton
    from triton.compiler import ASTSource

    signature = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
    return triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs), target=target).asm


def _kernel_specs(dt: str):
    from radixserve_triton.ops import attention as A
    from radixserve_triton.ops import elementwise as E
    from radixserve_triton.ops import moe as M

    p, i64, f32 = f"*{dt}", "*i64", "*fp32"
    up = dt == "fp32"
    # The attention kernels without a sliding window and logit cap, and with both (Gemma 2's values).
    attention_features = [
        dict(SLIDING_WINDOW=0, LOGIT_SOFTCAP=0.0),
        dict(SLIDING_WINDOW=4096, LOGIT_SOFTCAP=50.0 * A.LOG2E),
    ]
    return (
        [
            (
                A._store_kv_kernel,
                dict(K=p, V=p, KCache=p, VCache=p, Loc=i64),
                dict(HEAD_DIM=128, BLOCK_T=16, BLOCK_D=128, RNE_BF16=False),
            ),
            (
                A._decode_merge_kernel,
                dict(PartialO=f32, PartialLse=f32, Out=p),
                dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=4, BLOCK_S=4, RNE_BF16=False),
            ),
        ]
        + [
            (
                A._decode_partial_kernel,
                dict(
                    Q=p,
                    KCache=p,
                    VCache=p,
                    ReqToToken=i64,
                    ReqPoolIdx=i64,
                    SeqLens=i64,
                    PartialO=f32,
                    PartialLse=f32,
                    qk_scale="fp32",
                ),
                dict(
                    GROUP=4, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, NUM_SPLITS=4, UPCAST=up, RNE_BF16=False
                )
                | features,
            )
            for features in attention_features
        ]
        + [
            (
                A._extend_kernel,
                dict(
                    Q=p,
                    KCache=p,
                    VCache=p,
                    Out=p,
                    ReqToToken=i64,
                    ReqPoolIdx=i64,
                    PrefixLens=i64,
                    ExtendLens=i64,
                    ExtendStart=i64,
                    qk_scale="fp32",
                ),
                dict(GROUP=2, HEAD_DIM=128, BLOCK_M=32, BLOCK_N=64, BLOCK_D=128, UPCAST=up, RNE_BF16=False) | features,
            )
            for features in attention_features
        ]
        + [
            (
                M._moe_gate_up_kernel,
                dict(X=p, W13=p, Act=p, SortedIds=i64, BlockExpert=i64, NumPadded=i64),
                dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, UPCAST=up, RNE_BF16=False),
            ),
            (
                M._moe_down_kernel,
                dict(Act=p, W2=p, Out=f32, TopkWeights=f32, SortedIds=i64, BlockExpert=i64, NumPadded=i64),
                dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, UPCAST=up),
            ),
            (
                E._rms_norm_kernel,
                dict(X=p, R=p, W=p, Out=p, eps="fp32"),
                dict(HAS_RESIDUAL=True, BLOCK_ROWS=1, BLOCK=4096, ONE_BLOCK=True, RNE_BF16=False),
            ),
            (
                E._rms_norm_kernel,
                dict(X=p, R=p, W=p, Out=p, eps="fp32"),
                dict(HAS_RESIDUAL=False, BLOCK_ROWS=32, BLOCK=128, ONE_BLOCK=True, RNE_BF16=False),
            ),
            (
                E._rms_norm_kernel,
                dict(X=p, R=p, W=p, Out=p, eps="fp32"),
                dict(HAS_RESIDUAL=True, BLOCK_ROWS=1, BLOCK=8192, ONE_BLOCK=False, RNE_BF16=False),
            ),
            (
                E._rotary_kernel,
                dict(Q=p, K=p, Positions=i64, CosSin=p),
                dict(HALF=64, BLOCK_ROWS=32, BLOCK_HALF=64, NEOX=True, RNE_BF16=False),
            ),
            (
                E._rotary_kernel,
                dict(Q=p, K=p, Positions=i64, CosSin=p),
                dict(HALF=16, BLOCK_ROWS=64, BLOCK_HALF=16, NEOX=False, RNE_BF16=False),
            ),
            (E._act_and_mul_kernel, dict(X=p, Out=p), dict(BLOCK=1024, RNE_BF16=False, GELU_TANH=False)),
            (E._act_and_mul_kernel, dict(X=p, Out=p), dict(BLOCK=1024, RNE_BF16=False, GELU_TANH=True)),
        ]
    )


@has_triton
@pytest.mark.skipif(INTERPRETED, reason="compiles GPU code; the interpreter builds none")
@pytest.mark.parametrize(
    "backend,arch,dt",
    [("cuda", 90, "bf16"), ("cuda", 80, "fp32"), ("hip", "gfx942", "fp16")],
)
def test_kernels_compile_for_gpu_targets(backend, arch, dt, monkeypatch):
    """Catches GPU-only errors (dot shapes, dtypes, layouts) that the interpreter
    cannot: each kernel is compiled to device code for a real target."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the default; silences triton's warning
    from triton.backends.compiler import GPUTarget

    from radixserve_triton import ops

    if ops.INTERPRETED:
        pytest.skip("radixserve_triton.ops was imported in interpreter mode in this process")
    target = GPUTarget(backend, arch, 32 if backend == "cuda" else 64)
    binary = "cubin" if backend == "cuda" else "hsaco"
    for fn, types, constexprs in _kernel_specs(dt):
        try:
            asm = _compile(fn, types, constexprs, target)
        except RuntimeError as exc:  # a toolchain missing from this triton build, not a kernel bug
            if "ptxas" in str(exc) or "lld" in str(exc):
                pytest.skip(f"{backend} toolchain unavailable: {exc}")
            raise
        assert binary in asm, (fn.fn.__name__, sorted(asm))
