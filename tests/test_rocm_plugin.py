"""hardware/rocm (radixserve-plugin-rocm): installed through its entry point,
says why it cannot run here, parses HIP/ROCr visibility, and drives the Triton
kernels with CDNA launch configurations: checked against hand-computed
values, compiled for gfx90a/gfx942 (LDS within a CU's 64 KiB), and run through
the conformance kit in the Triton interpreter. ``rocm``-marked tests need an
AMD GPU."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers_platform import greedy_tokens_on, installed_plugins_report, needs_platform
from test_cli_startup import assert_short_failure

from radixserve.kernels import KernelQuery
from radixserve.registry import PluginError, PluginRegistry
from radixserve_rocm import CDNA_ATTENTION_CONFIG, CDNA_MOE_CONFIG, RocmPlatform, RocmTritonAttention, RocmTritonMoE
from radixserve_rocm.platform import build_reasons, reusable_free_bytes, visible_device_reasons
from radixserve_rocm.visibility import compose, parse_device_list, rocm_visible_devices
from radixserve_triton import DEFAULT_ATTENTION_CONFIG, DEFAULT_MOE_CONFIG

IS_ROCM_BUILD = bool(torch.version.hip)
has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


# --------------------------------------------------------------------------
# Installation and discovery


def test_installed_through_the_radixserve_entry_point():
    dist = importlib.metadata.distribution("radixserve-plugin-rocm")
    points = [ep for ep in dist.entry_points if ep.group == "radixserve"]
    assert [(ep.name, ep.value) for ep in points] == [("rocm", "radixserve_rocm")]
    # Depends on radixserve only; triton is an extra (ROCm builds of torch bring their own).
    required = [r for r in dist.requires or [] if "extra ==" not in r]
    assert required == ["radixserve"]
    registry = PluginRegistry()
    assert registry.plugins["rocm"].error is None
    assert registry.candidates["platform"]["rocm"].cls is RocmPlatform
    assert registry.candidates["attention"]["triton_rocm"].cls is RocmTritonAttention
    assert registry.candidates["moe"]["triton_rocm"].cls is RocmTritonMoE


@pytest.mark.skipif(IS_ROCM_BUILD, reason="this torch is a ROCm build")
def test_plugins_json_and_serve_say_why_rocm_is_unusable(cli_in_process):
    report = installed_plugins_report()
    row = next(r for r in report["backends"]["platform"] if r["name"] == "rocm")
    reason = f"torch {torch.__version__} is not a ROCm build (torch.version.hip is unset)"
    assert row["usable"] is False and row["plugin"] == "rocm" and row["reasons"][0].startswith(reason)
    attention = next(r for r in report["backends"]["attention"] if r["name"] == "triton_rocm")
    assert attention["usable"] is False and "runs on the rocm platform" in attention["reasons"][0]
    code, output = cli_in_process("serve", "--device", "rocm")
    assert_short_failure(code, output, "--device 'rocm'", "is not usable here", reason)
    with pytest.raises(PluginError, match=r"--device 'rocm' \(plugin 'rocm'\) is not usable here: torch"):
        PluginRegistry().resolve_platform("rocm")


def test_build_reasons():
    assert build_reasons("6.4.43482", None, "2.13.0+rocm6.4") == []
    cpu = build_reasons(None, None, "2.13.0+cpu")
    assert cpu == [
        "torch 2.13.0+cpu is not a ROCm build (torch.version.hip is unset); install torch for ROCm "
        "from https://pytorch.org/get-started/locally/"
    ]
    assert build_reasons(None, "12.8", "2.13.0+cu128")[0].endswith(
        "(this one is a CUDA build: use --device cuda with radixserve-plugin-cuda)"
    )


# --------------------------------------------------------------------------
# HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, None),
        ("0,2", (0, 2)),
        ("GPU-4a5b6c7d", ("GPU-4a5b6c7d",)),
        ("", ()),
        ("-1", ()),
        ("1,-1,0", (1,)),
        ("2,2", ()),
    ],
)
def test_device_list_parsing(value, expected):
    assert parse_device_list(value) == expected


@pytest.mark.parametrize(
    "env,ids,described",
    [
        ({}, None, "no visibility variable is set: every device is visible"),
        ({"HIP_VISIBLE_DEVICES": "1,3"}, (1, 3), "HIP_VISIBLE_DEVICES='1,3'"),
        # HIP picks by position among what ROCr left: positions 1, 2 of (0, 2, 3) are physical 2, 3.
        (
            {"ROCR_VISIBLE_DEVICES": "0,2,3", "HIP_VISIBLE_DEVICES": "1,2"},
            (2, 3),
            "ROCR_VISIBLE_DEVICES='0,2,3', HIP_VISIBLE_DEVICES='1,2'",
        ),
        # Position 1 of a one-device list does not exist: the selection ends there.
        ({"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "1"}, (), None),
        ({"ROCR_VISIBLE_DEVICES": "3,1"}, (3, 1), None),
        # CUDA_VISIBLE_DEVICES counts as HIP's when HIP_VISIBLE_DEVICES is unset, and only then.
        ({"CUDA_VISIBLE_DEVICES": "2"}, (2,), "CUDA_VISIBLE_DEVICES='2'"),
        ({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"}, (0,), "HIP_VISIBLE_DEVICES='0'"),
        ({"HIP_VISIBLE_DEVICES": ""}, (), None),
    ],
)
def test_rocm_visibility(env, ids, described):
    visible = rocm_visible_devices(env)
    assert visible.ids == ids
    if described is not None:
        assert visible.describe() == described


def test_visibility_reasons_and_physical_devices():
    visible = rocm_visible_devices({"ROCR_VISIBLE_DEVICES": "0,2,3", "HIP_VISIBLE_DEVICES": "1,2"})
    assert visible.physical(0) == 2 and visible.physical(1) == 3
    assert compose((4, 5), ("GPU-ab",)) == ("GPU-ab",)
    hidden = rocm_visible_devices({"HIP_VISIBLE_DEVICES": "-1"})
    assert visible_device_reasons(hidden, 8) == ["no ROCm device is visible: HIP_VISIBLE_DEVICES='-1' selects none"]
    assert "rocm-smi" in visible_device_reasons(rocm_visible_devices({}), 0)[0]
    assert visible_device_reasons(visible, 2) == []
    assert reusable_free_bytes(free=100, reserved=30, allocated=10) == 120


# --------------------------------------------------------------------------
# CDNA launch configurations


def test_cdna_attention_config():
    cdna, nv = CDNA_ATTENTION_CONFIG, DEFAULT_ATTENTION_CONFIG
    # 64-lane waves: decode keeps 128 lanes (2 waves), extend doubles the query block for 4 waves.
    assert cdna.launch_options(decode=True) == {"num_warps": 2, "num_stages": 1}
    assert cdna.launch_options() == {"num_warps": 4, "num_stages": 1}
    assert nv.launch_options(decode=True) == nv.launch_options() == {"num_warps": 4}
    assert (cdna.extend_block_m, cdna.store_block_t) == (64, 32)
    assert (nv.extend_block_m, nv.store_block_t) == (32, 16)
    assert [cdna.decode_block_n_for(d) for d in (64, 128, 256)] == [64, 64, 32]
    assert cdna.extend_block_n_for(128, torch.float32) == 64
    assert cdna.extend_block_n_for(256, torch.bfloat16) == 32
    assert cdna.extend_block_n_for(256, torch.float32) == 16
    # Splits: 8 requests x 8 KV heads = 64 programs; ceil(608 / 64) = 10 on CDNA, ceil(256 / 64) = 4 default.
    assert cdna.num_kv_splits(8, 8, 4096) == 10 and nv.num_kv_splits(8, 8, 4096) == 4
    assert cdna.num_kv_splits(1, 1, 4096) == 16  # at most 16 splits
    assert cdna.num_kv_splits(1, 8, 300) == 3  # each split keeps >= 128 keys: ceil(300 / 128)
    assert cdna.num_kv_splits(256, 8, 4096) == 1


def test_cdna_moe_config():
    cdna, nv = CDNA_MOE_CONFIG, DEFAULT_MOE_CONFIG
    assert cdna.launch_options() == {"num_warps": 4, "num_stages": 2}
    # 16 assignments over 8 experts (2 rows each): decode-sized M blocks; K blocks 64 deep in 16-bit dtypes.
    assert cdna.blocks(16, 8, torch.bfloat16) == (16, 64, 64)
    assert cdna.blocks(16, 8, torch.float32) == (16, 64, 32)
    assert nv.blocks(16, 8, torch.bfloat16) == (16, 64, 32)
    assert cdna.blocks(8 * 40, 8, torch.float16)[0] == 32  # 40 rows per expert
    assert cdna.blocks(8 * 100, 8, torch.float16)[0] == 64


def test_rocm_backends_serve_rocm_only(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for cls in (RocmTritonAttention, RocmTritonMoE):
        for device in ("cpu", "cuda"):
            reasons = cls.unsupported_reasons(KernelQuery(device=device, dtype=torch.bfloat16))
            assert len(reasons) == 1 and f"runs on the rocm platform, not {device!r}" in reasons[0]
    rocm = KernelQuery(
        device="rocm", dtype=torch.bfloat16, head_dim=128, num_heads=8, num_kv_heads=2, num_experts=8, top_k=2
    )
    if importlib.util.find_spec("triton") is not None:
        assert RocmTritonAttention.unsupported_reasons(rocm) == []
        assert RocmTritonMoE.unsupported_reasons(rocm) == []
        # On rocm, auto prefers the CDNA configurations over the generic triton backends.
        registry = PluginRegistry()
        assert registry.select("attention", rocm) is RocmTritonAttention
        assert registry.select("moe", rocm) is RocmTritonMoE
    too_big = KernelQuery(device="rocm", dtype=torch.bfloat16, head_dim=512)
    assert any("head_dim 512" in r for r in RocmTritonAttention.unsupported_reasons(too_big))


def test_without_triton_rocm_serves_through_torch_backends():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # importlib then finds no triton, and importing it fails
        import torch
        from radixserve.kernels import KernelQuery
        from radixserve.registry import PluginRegistry
        registry = PluginRegistry()
        query = KernelQuery(device="rocm", dtype=torch.bfloat16, head_dim=64, num_heads=4, num_kv_heads=2,
                            num_experts=4, top_k=2)
        print(*(registry.candidates[kind][registry.select(kind, query).name].plugin for kind in ("attention", "moe")))
        print(registry.candidates["attention"]["triton_rocm"].cls.unsupported_reasons(query))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    picked, reasons = out.stdout.strip().splitlines()
    assert picked == "torch torch"  # the torch plugin serves both
    assert "triton is not installed" in reasons


def _lds_bytes(fn, types: dict, constexprs: dict, arch: str, options: dict) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
    kernel = triton.compile(
        ASTSource(fn, signature=signature, constexprs=constexprs), target=GPUTarget("hip", arch, 64), options=options
    )
    assert "hsaco" in kernel.asm
    return kernel.metadata.shared


def _attention_lds(
    config, dt: str, head_dim: int, arch: str, kernels=("store", "decode", "extend"), window=0, softcap=0.0
) -> dict:
    """LDS bytes of each attention kernel as ``config`` launches it (fp16/bf16: same sizes),
    for layers with the sliding ``window`` and logit ``softcap`` given (0: none)."""
    from radixserve_triton.ops import attention as A

    features = dict(SLIDING_WINDOW=window, LOGIT_SOFTCAP=softcap)

    p, i64, f32, up = f"*{dt}", "*i64", "*fp32", dt == "fp32"
    dtype = torch.float32 if dt == "fp32" else torch.float16
    compile_one = {
        "store": lambda: _lds_bytes(
            A._store_kv_kernel,
            dict(K=p, V=p, KCache=p, VCache=p, Loc=i64),
            dict(HEAD_DIM=head_dim, BLOCK_T=config.store_block_t, BLOCK_D=head_dim, RNE_BF16=False),
            arch,
            config.launch_options(),
        ),
        "decode": lambda: _lds_bytes(
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
                GROUP=8,
                HEAD_DIM=head_dim,
                BLOCK_H=16,
                BLOCK_D=head_dim,
                BLOCK_N=config.decode_block_n_for(head_dim),
                NUM_SPLITS=4,
                UPCAST=up,
                RNE_BF16=False,
                **features,
            ),
            arch,
            config.launch_options(decode=True),
        ),
        "extend": lambda: _lds_bytes(
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
            dict(
                GROUP=2,
                HEAD_DIM=head_dim,
                BLOCK_M=config.extend_block_m,
                BLOCK_N=config.extend_block_n_for(head_dim, dtype),
                BLOCK_D=head_dim,
                UPCAST=up,
                RNE_BF16=False,
                **features,
            ),
            arch,
            config.launch_options(),
        ),
    }
    return {name: compile_one[name]() for name in kernels}


def _moe_lds(config, dt: str, arch: str) -> dict[str, int]:
    from radixserve_triton.ops import moe as M

    p, i64, f32, up = f"*{dt}", "*i64", "*fp32", dt == "fp32"
    block_m, block_n, block_k = config.blocks(10_000, 8, torch.float32 if up else torch.float16)  # large blocks
    blocks = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=up)
    return {
        "gate_up": _lds_bytes(
            M._moe_gate_up_kernel,
            dict(X=p, W13=p, Act=p, SortedIds=i64, BlockExpert=i64, NumPadded=i64),
            {**blocks, "RNE_BF16": False},
            arch,
            config.launch_options(),
        ),
        "down": _lds_bytes(
            M._moe_down_kernel,
            dict(Act=p, W2=p, Out=f32, TopkWeights=f32, SortedIds=i64, BlockExpert=i64, NumPadded=i64),
            blocks,
            arch,
            config.launch_options(),
        ),
    }


CDNA_LDS = 64 * 1024


@has_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles GPU code; the interpreter builds none")
def test_cdna_configs_compile_within_a_cus_lds(monkeypatch):
    """Every kernel compiles for CDNA3 (and, in the largest case, CDNA2) with the
    CDNA configurations, within 64 KiB of LDS (two workgroups per CU in 16-bit
    dtypes at head dim 128); the NVIDIA defaults would not fit float32 decode."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    from radixserve_triton import ops

    if ops.INTERPRETED:
        pytest.skip("radixserve_triton.ops was imported in interpreter mode in this process")
    try:
        cases = [("gfx942", "fp16", 128), ("gfx942", "fp32", 128), ("gfx942", "fp32", 256), ("gfx90a", "fp32", 128)]
        for arch, dt, head_dim in cases:
            sizes = _attention_lds(CDNA_ATTENTION_CONFIG, dt, head_dim, arch)
            assert max(sizes.values()) <= CDNA_LDS, (arch, dt, head_dim, sizes)
            if dt == "fp16":
                assert max(sizes.values()) <= CDNA_LDS // 2, sizes
        # A sliding window and a logit cap (Gemma 2's: 50, in the kernels' base-2 units) fit as well.
        cap = 50.0 * 1.4426950408889634
        capped = _attention_lds(CDNA_ATTENTION_CONFIG, "fp32", 128, "gfx942", ("decode", "extend"), 4096, cap)
        assert max(capped.values()) <= CDNA_LDS, capped
        for arch, dt in (("gfx942", "fp16"), ("gfx942", "fp32"), ("gfx90a", "fp32")):
            moe = _moe_lds(CDNA_MOE_CONFIG, dt, arch)
            assert max(moe.values()) <= CDNA_LDS // 2, (arch, dt, moe)
        default = _attention_lds(DEFAULT_ATTENTION_CONFIG, "fp32", 128, "gfx942", kernels=("decode",))
        assert default["decode"] > CDNA_LDS, default
    except RuntimeError as exc:  # a toolchain missing from this triton build, not a config problem
        if "lld" in str(exc):
            pytest.skip(f"hip toolchain unavailable: {exc}")
        raise


INTERPRETER_KIT = textwrap.dedent("""
    import torch
    from radixserve.testing import ATTENTION_CASES, MOE_CASES, check_attention_backend, check_moe_backend
    from radixserve_triton import TritonAttention, TritonMoE
    from radixserve_rocm import RocmTritonAttention, RocmTritonMoE

    # The CDNA-configured backends with the rocm-only check lifted: the same
    # kernels and launch configurations, run by Triton's CPU interpreter.
    class CdnaAttentionOnCpu(RocmTritonAttention):
        unsupported_reasons = TritonAttention.unsupported_reasons

    class CdnaMoEOnCpu(RocmTritonMoE):
        unsupported_reasons = TritonMoE.unsupported_reasons

    dtypes = [torch.float32, torch.bfloat16]
    for report, cases in ((check_attention_backend(CdnaAttentionOnCpu, cases="quick", dtypes=dtypes),
                           ATTENTION_CASES["quick"]),
                          (check_moe_backend(CdnaMoEOnCpu, cases="quick", dtypes=dtypes), MOE_CASES["quick"])):
        print(report)
        report.raise_for_failures(min_run=len(dtypes) * len(cases))
    print("KIT OK")
""")


@has_triton
def test_cdna_kernels_pass_the_kit_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", INTERPRETER_KIT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "KIT OK" in out.stdout, out.stdout + out.stderr
    assert "attention backend 'triton_rocm' vs torch_native on cpu" in out.stdout
    assert "moe backend 'triton_rocm' vs torch_native on cpu" in out.stdout


# --------------------------------------------------------------------------
# On an AMD GPU


needs_rocm = needs_platform("rocm")


@pytest.mark.rocm
@needs_rocm
def test_cdna_kits_on_rocm():
    from radixserve.testing import ATTENTION_CASES, MOE_CASES, check_attention_backend, check_moe_backend

    for report, cases in (
        (check_attention_backend("triton_rocm", device="rocm", cases="full"), ATTENTION_CASES["full"]),
        (check_moe_backend("triton_rocm", device="rocm", cases="full"), MOE_CASES["full"]),
    ):
        print(report)
        report.raise_for_failures(min_run=3 * len(cases))  # every case, in all three dtypes


@pytest.mark.rocm
@needs_rocm
def test_rocm_greedy_tokens_equal_cpu(tiny_llama_dir):
    assert greedy_tokens_on("rocm", tiny_llama_dir) == greedy_tokens_on("cpu", tiny_llama_dir)
