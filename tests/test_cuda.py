"""GPU checks: the Triton backends on a real CUDA device, through the kit and a
whole generation. Marked ``cuda``; they skip with the platform's own reason
where no usable CUDA platform is registered (every CI machine).
Run them with scripts/gpu_check.sh on a machine with an NVIDIA GPU."""

from __future__ import annotations

import pytest
from generation_utils import mixed_prompts
from helpers_platform import needs_platform

from radixserve import Engine
from radixserve.testing import ATTENTION_CASES, MOE_CASES, check_attention_backend, check_moe_backend

pytestmark = [pytest.mark.cuda, needs_platform("cuda")]


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_attention_kit_on_cuda(backend):
    report = check_attention_backend(backend, device="cuda", cases="full")
    print(report)
    report.raise_for_failures(min_run=3 * len(ATTENTION_CASES["full"]))  # every case, in all three dtypes


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_moe_kit_on_cuda(backend):
    report = check_moe_backend(backend, device="cuda", cases="full")
    print(report)
    report.raise_for_failures(min_run=3 * len(MOE_CASES["full"]))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_triton_generation_on_cuda_matches_torch(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch=arch)
    prompts = mixed_prompts(512, [5, 30, 17], seed=51, shared_prefix=16)
    params = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    outputs = {}
    for backend in ("torch_native", "triton"):
        moe = backend if arch == "qwen3_moe" else "auto"
        with Engine(
            model_path=str(model_dir),
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            moe_backend=moe,
            max_total_tokens=8192,
            page_size=16,
            log_level="warning",
        ) as engine:
            assert engine.server_info()["platform"] == "cuda"
            outputs[backend] = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
    assert outputs["triton"] == outputs["torch_native"]
