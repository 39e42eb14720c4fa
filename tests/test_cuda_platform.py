"""hardware/cuda: the logic that runs without a GPU (visibility, memory figures,
compute-capability reasons, fp8 scales and the fp8 method on CPU's
``torch._scaled_mm``), the plugin as installed, and ``cuda``-marked checks that
need an NVIDIA GPU (pool sized from free memory, fp8 through the kit, greedy
tokens equal to the CPU's)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch
from helpers_platform import greedy_tokens_on, installed_plugins_report, needs_platform
from test_cli_startup import assert_short_failure

from radixserve.cache.memory_pool import KVPool
from radixserve.registry import PluginError, PluginRegistry, get_registry
from radixserve.runtime.execution.model_runner import kv_pool_tokens
from radixserve.testing import check_quantization_method
from radixserve.testing.conformance import QUANT_REFERENCES
from radixserve_cuda.capability import capability_reasons, visible_capabilities
from radixserve_cuda.fp8 import Fp8W8A8, Fp8W8A8PerTensor, dequantize, fp8_linear, quantize, token_scales, weight_scales
from radixserve_cuda.platform import CudaPlatform, reusable_free_bytes, visible_device_reasons
from radixserve_cuda.visibility import cuda_visible_devices, parse_device_list

GiB = 2**30
IS_CUDA_BUILD = torch.version.cuda is not None


# --------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, None),  # unset: every device
        ("0,2", (0, 2)),
        (" 3 , 1", (3, 1)),  # order kept: physical 3 becomes cuda:0
        ("GPU-8932f937-d72c", ("GPU-8932f937-d72c",)),
        ("MIG-4b1c", ("MIG-4b1c",)),
        ("", ()),  # set but empty: nothing
        ("-1", ()),
        ("0,2,-1,1", (0, 2)),  # the list ends at the first invalid entry
        ("1,gpu3", (1,)),
        ("1,1", ()),  # a repeated device: nothing
    ],
)
def test_cuda_visible_devices_parsing(value, expected):
    assert parse_device_list(value) == expected


def test_visible_devices_map_logical_to_physical():
    visible = cuda_visible_devices({"CUDA_VISIBLE_DEVICES": "0,2"})
    assert (visible.physical(0), visible.physical(1)) == (0, 2)
    assert visible.describe() == "CUDA_VISIBLE_DEVICES='0,2'" and not visible.hides_all
    with pytest.raises(IndexError, match=r"device 2 is not visible \(CUDA_VISIBLE_DEVICES='0,2'\)"):
        visible.physical(2)
    assert cuda_visible_devices({}).physical(5) == 5
    hidden = cuda_visible_devices({"CUDA_VISIBLE_DEVICES": "-1"})
    assert hidden.hides_all
    assert visible_device_reasons(hidden, 4) == ["no CUDA device is visible: CUDA_VISIBLE_DEVICES='-1' selects none"]
    assert "nvidia-smi" in visible_device_reasons(cuda_visible_devices({}), 0)[0]
    assert visible_device_reasons(visible, 2) == []


# --------------------------------------------------------------------------
# Memory: what the platform reports, and the KV pool sized from it


def test_reusable_free_memory_counts_the_caching_allocators_idle_blocks():
    assert reusable_free_bytes(free=10 * GiB, reserved=3 * GiB, allocated=2 * GiB) == 11 * GiB
    assert reusable_free_bytes(free=10 * GiB, reserved=2 * GiB, allocated=2 * GiB) == 10 * GiB


def test_kv_pool_sized_from_reported_memory():
    # A Llama-3.1-8B-shaped cache in bf16: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 128 KiB a token.
    per_token = KVPool.bytes_per_token(32, 8, 128, torch.bfloat16)
    assert per_token == 128 * 1024
    weights = 16 * GiB
    # An idle 80 GiB device after loading: 63 GiB free, 1 GiB cached by torch (0.5 GiB of it in use).
    free = reusable_free_bytes(63 * GiB, 1 * GiB, GiB // 2)
    # 0.85 x 80 - 16 = 52 GiB (the fraction binds; 0.9 x 63.5 = 57.15 GiB) -> 52 x 8192 tokens.
    assert kv_pool_tokens(80 * GiB, free, weights, 0.85, per_token, 10**9) == 52 * 8192
    # Another process holds 40 GiB: 0.9 x 24 GiB = 21.6 GiB -> 176947.2 -> 176947 tokens.
    assert kv_pool_tokens(80 * GiB, 24 * GiB, weights, 0.85, per_token, 10**9) == 176947
    # Never more than every running request at full context.
    assert kv_pool_tokens(80 * GiB, free, weights, 0.85, per_token, 64 * 4096) == 64 * 4096
    # Weights beyond the fraction: no room at all (the runner then refuses to start).
    assert kv_pool_tokens(80 * GiB, free, 70 * GiB, 0.85, per_token, 10**9) == 0


# --------------------------------------------------------------------------
# Compute capability


def test_capability_reasons_name_the_devices_below_the_minimum():
    assert capability_reasons([(9, 0)], (8, 9), "fp8") == []
    assert capability_reasons([(8, 9), (10, 0)], (8, 9), "fp8") == []
    assert capability_reasons([(8, 0)], (8, 9), "fp8") == [
        "fp8 needs compute capability >= 8.9 (Ada, Hopper or newer); cuda:0 is 8.0"
    ]
    assert capability_reasons([(9, 0), (8, 6)], (8, 9), "fp8") == [
        "fp8 needs compute capability >= 8.9 (Ada, Hopper or newer); cuda:1 is 8.6"
    ]
    assert capability_reasons([], (8, 9), "fp8") == [
        "fp8 needs a CUDA device of compute capability >= 8.9; none is visible"
    ]


# --------------------------------------------------------------------------
# fp8: scales, rounding and the dequantized reference, by hand


def test_fp8_scales_and_rounding():
    w = torch.tensor([[1.0, -2.0, 4.0], [0.5, 0.0, -0.25]])
    assert torch.equal(weight_scales(w, per_channel=True), torch.tensor([4.0, 0.5]) / 448)
    assert torch.equal(weight_scales(w, per_channel=False), torch.tensor([4.0]) / 448)
    # Rows scaled to the e4m3 range: every value here is exactly representable.
    q = quantize(w, weight_scales(w, per_channel=True)[:, None])
    assert q.dtype == torch.float8_e4m3fn
    assert q.float().tolist() == [[112.0, -224.0, 448.0], [448.0, 0.0, -224.0]]
    assert torch.allclose(dequantize(q, weight_scales(w, True)[:, None]), w)
    # Round to nearest even: 17 lies between 16 and 18 (step 2) -> 16; 19 -> 20; beyond 448 -> clamped.
    one = torch.ones(1)
    assert quantize(torch.tensor([17.0, 19.0, 500.0, -1000.0]), one).float().tolist() == [16.0, 20.0, 448.0, -448.0]
    # Per-token activation scales; an all-zero token gets a tiny scale, not a zero one.
    scales = token_scales(torch.tensor([[0.0, 0.0], [3.0, -6.0]], dtype=torch.bfloat16))
    assert scales.dtype == torch.float32 and scales.shape == (2, 1)
    assert scales[1, 0].item() == pytest.approx(6 / 448) and scales[0, 0].item() == pytest.approx(1e-12 / 448)


def test_fp8_reference_and_linear_by_hand():
    w = torch.tensor([[1.0, -2.0, 4.0], [0.5, 0.0, -0.25]])
    x = torch.tensor([[1.0, 2.0, 3.0]])
    # x / (3/448) = [149.3, 298.7, 448] -> e4m3 [144, 288, 448] (steps of 16 and 32 there).
    # y0 = (144*1 - 288*2 + 448*4) * 3/448 = 1360 * 3/448; y1 = (144*0.5 - 448*0.25) * 3/448 = -40 * 3/448.
    expected = torch.tensor([[1360 * 3 / 448, -40 * 3 / 448]])
    bias = torch.tensor([0.5, -1.0])
    ref = QUANT_REFERENCES["fp8"](w, x, bias)
    assert torch.allclose(ref, expected + bias, atol=1e-6)
    # The plugin's product on CPU's torch._scaled_mm. torch._scaled_mm wants dims divisible by 16 on GPUs,
    # not on CPU, so the hand example runs as is.
    scale_w = weight_scales(w, True)
    out = fp8_linear(x.half(), quantize(w, scale_w[:, None]), scale_w.reshape(1, -1), bias.half())
    assert out.dtype == torch.float16
    assert torch.allclose(out.float(), expected + bias, atol=1e-2)


def _on_cpu(method: type) -> type:
    """The method with its device check lifted, so the kit drives it on CPU's torch._scaled_mm."""

    class OnCpu(method):
        @classmethod
        def unsupported_reasons(cls, query):
            return [] if query.dtype in (torch.bfloat16, torch.float16) else [f"{query.dtype} is not 16-bit"]

    return OnCpu


@pytest.mark.parametrize("method", [Fp8W8A8, Fp8W8A8PerTensor])
def test_fp8_lifecycle_passes_the_kit_on_cpu(method):
    report = check_quantization_method(_on_cpu(method))
    print(report)
    report.raise_for_failures()
    assert {r.dtype for r in report.results} == {"bfloat16", "float16"}
    # The quantization error is real: against unquantized weights it fails in float16.
    dense = check_quantization_method(
        _on_cpu(method), dtypes=[torch.float16], reference=lambda w, x, b: torch.nn.functional.linear(x, w, b)
    )
    assert not dense.ok


def test_fp8_refuses_misaligned_layers():
    layer = torch.nn.Module()
    method = Fp8W8A8(None, None)
    method.create_weights(layer, 24, 32, torch.bfloat16, lambda p, t: p.data.copy_(t))
    with pytest.raises(ValueError, match=r"quantization: fp8 needs .* divisible by 16 .* got out=32, in=24"):
        method.process_weights_after_loading(layer)


def test_fp8_unsupported_reasons_here():
    from radixserve.kernels import KernelQuery

    reasons = Fp8W8A8.unsupported_reasons(KernelQuery(device="cpu", dtype=torch.float32))
    assert reasons[0] == "fp8 w8a8 runs on the cuda platform (torch._scaled_mm), not 'cpu'"
    assert "serves bfloat16 or float16 models" in reasons[1] and "--dtype bfloat16" in reasons[1]
    if not IS_CUDA_BUILD:
        assert visible_capabilities() == []
        assert Fp8W8A8.unsupported_reasons(KernelQuery(device="cuda", dtype=torch.bfloat16)) == [
            "fp8 w8a8 (torch._scaled_mm) needs a CUDA device of compute capability >= 8.9; none is visible"
        ]


# --------------------------------------------------------------------------
# The plugin as installed, on a machine without a GPU


def test_probing_creates_no_cuda_context():
    """The server process probes the platform and fp8 before spawning the
    scheduler; neither may initialise CUDA there (NVML answers)."""
    code = (
        "import torch; from radixserve.kernels import KernelQuery; "
        "from radixserve_cuda import CudaPlatform, Fp8W8A8; "
        "CudaPlatform.unavailable_reasons(); "
        "Fp8W8A8.unsupported_reasons(KernelQuery(device='cuda', dtype=torch.bfloat16)); "
        "print(torch.cuda.is_initialized())"
    )
    if any(str(d).startswith("MIG-") for d in cuda_visible_devices().ids or ()):
        pytest.skip("NVML cannot map MIG instances: torch answers there, initialising CUDA")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_device_index_from_base_gpu_id():
    from radixserve.config import ServerArgs

    with pytest.raises(ValueError, match=r"base_gpu_id: must be >= 0, got -1"):
        ServerArgs(base_gpu_id=-1)
    count = torch.cuda.device_count()
    with pytest.raises(
        ValueError,
        match=rf"base_gpu_id: cuda:{count} does not exist: {count} device\(s\) are "
        r"visible \(CUDA_VISIBLE_DEVICES",
    ):
        CudaPlatform().device(count)


@pytest.mark.skipif(IS_CUDA_BUILD and torch.cuda.is_available(), reason="this machine can run cuda")
def test_plugins_json_and_serve_say_why_cuda_is_unusable(cli_in_process):
    report = installed_plugins_report()
    plugin = next(p for p in report["plugins"] if p["name"] == "cuda")
    assert plugin["distribution"] == "radixserve-plugin-cuda" and plugin["error"] is None
    assert {"fp8", "fp8_per_tensor"} <= set(plugin["registered"]["quantization"])
    row = next(r for r in report["backends"]["platform"] if r["name"] == "cuda")
    reason = CudaPlatform.unavailable_reasons()[0]
    assert row["usable"] is False and row["reasons"] == [reason]
    assert "not a CUDA build" in reason or "no CUDA device is visible" in reason
    code, output = cli_in_process("serve", "--device", "cuda")
    assert_short_failure(code, output, "--device 'cuda'", "is not usable here", reason)
    with pytest.raises(PluginError, match="is not usable here"):
        PluginRegistry().resolve_platform("cuda")


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # importlib then finds no triton, and importing it fails
import torch
from radixserve.kernels import KernelQuery
from radixserve.registry import PluginRegistry
from radixserve_cuda import CudaPlatform
registry = PluginRegistry()
query = KernelQuery(device="cuda", dtype=torch.bfloat16, head_dim=64, num_heads=4, num_kv_heads=2,
                    num_experts=4, top_k=2)
print(*(registry.candidates[kind][registry.select(kind, query).name].plugin for kind in ("attention", "moe")))
print(registry.candidates["attention"]["triton"].cls.unsupported_reasons(query))
print(CudaPlatform.unavailable_reasons())
"""


def test_cuda_platform_does_not_need_triton():
    """Without triton, only the Triton backends are unusable (with their reason);
    auto takes the torch ones and the platform's reasons never mention triton."""
    out = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, check=True)
    picked, triton_reasons, platform_reasons = out.stdout.strip().splitlines()
    assert picked == "torch torch"  # the torch plugin serves both
    assert triton_reasons == "[\"triton is not installed (pip install 'radixserve[triton]')\"]"
    assert "triton" not in platform_reasons


# --------------------------------------------------------------------------
# On an NVIDIA GPU


needs_cuda = needs_platform("cuda")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("method", ["fp8", "fp8_per_tensor"])
def test_fp8_kit_on_cuda(method):
    from radixserve.kernels import KernelQuery

    reasons = Fp8W8A8.unsupported_reasons(KernelQuery(device="cuda", dtype=torch.bfloat16))
    if reasons:
        pytest.skip(reasons[0])
    report = check_quantization_method(method, device="cuda")
    print(report)
    report.raise_for_failures()


@pytest.mark.cuda
@needs_cuda
def test_cuda_pool_sized_from_free_memory(tiny_model_factory):
    from radixserve.config import ServerArgs
    from radixserve.runtime.execution.model_runner import ModelRunner

    model = str(tiny_model_factory(arch="llama", num_kv_heads=4, head_dim=64))  # 4 KiB of KV per token in fp32
    args = ServerArgs(
        model_path=model,
        device="cuda",
        dtype="float32",
        mem_fraction_static=1.0,
        max_running_requests=4096,
        disable_graph=True,
    )
    per_token = KVPool.bytes_per_token(2, 4, 64, torch.float32)
    free = CudaPlatform().available_memory_bytes()
    blocker = torch.empty(free - 3 * GiB, dtype=torch.uint8, device="cuda")  # leaves about 3 GiB
    runner = ModelRunner(args, model, get_registry())
    small = runner.max_total_tokens * per_token
    assert 0.5 * 3 * GiB < small <= 0.9 * 3 * GiB, small / GiB
    del runner, blocker
    gc.collect()  # the model and its context refer to each other
    torch.cuda.empty_cache()
    runner = ModelRunner(args, model, get_registry())
    assert runner.max_total_tokens * per_token > 2 * small


@pytest.mark.cuda
@needs_cuda
def test_cuda_greedy_tokens_equal_cpu(tiny_llama_dir):
    assert greedy_tokens_on("cuda", tiny_llama_dir) == greedy_tokens_on("cpu", tiny_llama_dir)
