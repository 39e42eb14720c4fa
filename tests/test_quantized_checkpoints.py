"""Checkpoints that ship quantized (GPTQ, AWQ), made here by each format's layout from a
random-weight Llama (radixserve.testing.quantized_checkpoints): the quantization method comes from config.json,
greedy generation equals HF transformers running the dequantized weights, the int4
kernel a bfloat16 model runs agrees with the dequantized product, and what is not
served is refused naming the field."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from generation_utils import hf_greedy
from helpers_models import LOGPROB_TOL, Reference, check_greedy_matches_hf, hf_reference, teacher_forced_agreement
from helpers_server import ServerProcess
from helpers_tp import MAX_NEW_TOKENS, RankPool, run_ranks, script
from safetensors.torch import save_file
from transformers import PretrainedConfig

from radixserve import Engine
from radixserve.checkpoints.loader import load_config, model_kernel_query
from radixserve.checkpoints.quantized import checkpoint_quantization, resolve_quantization
from radixserve.kernels import KernelQuery, QuantizedCheckpoint
from radixserve.layers import MergedColumnParallelLinear, RowParallelLinear
from radixserve.layers.context import ModelContext
from radixserve.registry import get_registry
from radixserve.testing import check_quantization_method
from radixserve.testing.conformance import QUANT_CASES
from radixserve.testing.quantized_checkpoints import pack_weight, scheme_of, write_gguf, write_quantized
from radixserve_torch.quantized_checkpoints import (
    GPTQ,
    AtenInt4,
    ByteStrips,
    FloatByteStrips,
    FloatNibbleStrips,
    NibbleStrips,
    SevenBitStrips,
    dequantize,
    unpack_columns,
)

FORMATS = {
    "gptq-4bit-asym": dict(method="gptq", bits=4, group=32, sym=False),
    "gptq-4bit-sym": dict(method="gptq", bits=4, group=64, sym=True),
    "gptq-8bit": dict(method="gptq", bits=8, group=32, sym=False),
    "gptq-4bit-act-order": dict(method="gptq", bits=4, group=32, sym=False, desc_act=True),
    "awq-4bit": dict(method="awq", bits=4, group=32),
    "compressed-tensors-w4a16-sym": dict(method="compressed-tensors", bits=4, group=32, sym=True),
    "compressed-tensors-w4a16-asym": dict(method="compressed-tensors", bits=4, group=32, sym=False),
    "compressed-tensors-w8a16-channel": dict(method="compressed-tensors", bits=8, group=-1, sym=True),
    "fp8-blocks": dict(method="fp8_block", bits=8, group=32),
}


@pytest.fixture(scope="module", params=list(FORMATS))
def quantized(request, tiny_llama_dir: Path, tmp_path_factory) -> tuple[Path, Path]:
    """(the quantized checkpoint, the same model dequantized)."""
    root = tmp_path_factory.mktemp(request.param)
    out, reference = root / "quantized", root / "dequantized"
    write_quantized(tiny_llama_dir, out, reference, **FORMATS[request.param])
    return out, reference


def test_greedy_tokens_equal_hf_on_the_dequantized_weights(quantized):
    out, reference_dir = quantized
    hf = hf_reference(reference_dir, [5, 17, 33], new_tokens=24)
    check_greedy_matches_hf(Reference(out, hf.prompts, hf.new_tokens, hf.hf), "radix-cache")


def assert_served_greedy_tokens(server: ServerProcess, hf: Reference) -> None:
    """Each of ``hf``'s prompts through ``server``'s /generate, greedy: HF's tokens."""
    for prompt, (want, _) in zip(hf.prompts, hf.hf, strict=True):
        params = {"max_new_tokens": hf.new_tokens, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(server.url + "/generate", json={"input_ids": prompt, "sampling_params": params})
        assert answer.status_code == 200, answer.text
        assert answer.json()["output_ids"] == want


# Formats served at --tp-size 2: (architecture, write_quantized's arguments).
TP_FORMATS = {
    "gptq": ("llama", dict(method="gptq")),
    "awq": ("llama", dict(method="awq")),
    "compressed-tensors": ("llama", dict(method="compressed-tensors")),
    "compressed-tensors-w8a16-channel": ("llama", dict(method="compressed-tensors", bits=8, group=-1, sym=True)),
    "fp8_block": ("llama", dict(method="fp8_block")),
    "mixtral-gptq": ("mixtral", dict(method="gptq")),
}


def test_two_tensor_parallel_ranks_give_hfs_greedy_tokens(tiny_llama_dir, tiny_model_factory, tmp_path):
    """Every format at tp 2 (two rank processes over gloo, each loading its slices of the
    packed tensors: fused q/k/v and gate/up split by rows, o and down by input groups;
    one group a row, by channel, replicated on both; a quantized Mixtral's experts each
    sliced, dequantized whole at load), under the tensor-parallel tests' load (queueing,
    chunked prefill, radix cache hits, aborts): both ranks answer alike, and every greedy
    request that ran to its end has HF's greedy tokens on the dequantized weights."""
    checkpoints = {}
    for name, (arch, spec) in TP_FORMATS.items():
        base = tiny_llama_dir if arch == "llama" else tiny_model_factory(arch=arch)
        out, reference_dir = tmp_path / name / "q", tmp_path / name / "r"
        write_quantized(base, out, reference_dir, **spec)
        checkpoints[out] = reference_dir
    pool = RankPool(2)
    try:
        ranks = run_ranks(pool, list(checkpoints), 2)
    finally:
        pool.close()
    for out, reference_dir in checkpoints.items():
        first, second = (rank[str(out)] for rank in ranks)
        prompts = {req.rid: req.input_ids for _, req in script(load_config(out).vocab_size)}
        finished = [rid for rid, r in first.items() if rid.startswith("g") and r.finish == "length"]
        assert len(finished) >= 4, (out, {rid: r.finish for rid, r in first.items()})
        for rid in finished:
            assert second[rid].output_ids == first[rid].output_ids, (out, rid)
            want_ids, want_logprobs = hf_greedy(reference_dir, prompts[rid], MAX_NEW_TOKENS)
            assert first[rid].output_ids == want_ids, (out, rid)
            worst = max(abs(a - b) for a, b in zip(first[rid].logprobs, want_logprobs, strict=True))
            assert worst < LOGPROB_TOL, (out, rid, worst)


def test_the_method_comes_from_the_checkpoint(quantized):
    out, _ = quantized
    config = load_config(out)
    query = model_kernel_query(config, "cpu", torch.float32)
    # FP8 checkpoints' method is fp8_block: fp8 is the CUDA plugin's, quantizing at load.
    quant_method = config.quantization_config["quant_method"]
    assert query.quantization == {"fp8": "fp8_block"}.get(quant_method, quant_method)
    assert query.quantized_checkpoint == checkpoint_quantization(config)
    with pytest.raises(ValueError, match=f"--quantization int8 for a {query.quantization} checkpoint"):
        resolve_quantization(config, "int8")


def _query(scheme: QuantizedCheckpoint, dtype: torch.dtype = torch.bfloat16) -> KernelQuery:
    return KernelQuery(device="cpu", dtype=dtype, quantization=scheme.method, quantized_checkpoint=scheme)


def _layer(scheme: QuantizedCheckpoint, dtype: torch.dtype) -> MergedColumnParallelLinear:
    ctx = ModelContext.create(get_registry(), _query(scheme, dtype), torch.device("cpu"), quantization=scheme.method)
    return MergedColumnParallelLinear(256, [128, 128], ctx)


@pytest.mark.parametrize("format_name", list(FORMATS))
def test_each_format_passes_the_quantization_kit(format_name):
    """The kit packs random weights as the format ships them, loads them through the
    method, and compares with the dequantized product: float32 (the reference path)
    and bfloat16 (4-bit: ATen's int4 kernel)."""
    spec = FORMATS[format_name]
    scheme = scheme_of(spec["method"], spec["bits"], spec["group"], spec.get("sym", False), spec.get("desc_act", False))
    report = check_quantization_method(spec["method"], dtypes=(torch.float32, torch.bfloat16), checkpoint=scheme)
    report.raise_for_failures(min_run=2 * len(QUANT_CASES["standard"]))


@pytest.mark.parametrize(("bits", "sym"), [(4, False), (4, True), (5, False), (8, True)])
def test_the_gguf_method_passes_the_quantization_kit(bits, sym):
    """GGUF's types as the kit packs them (``gguf_type``: Q4_K and Q5_K where a case's
    inputs fill their blocks, Q4_1, Q5_1 elsewhere; Q4_0; Q8_0), against the gguf
    package's own dequantization."""
    report = check_quantization_method(
        "gguf", dtypes=(torch.float32, torch.bfloat16), checkpoint=scheme_of("gguf", bits, 32, sym)
    )
    report.raise_for_failures(min_run=2 * len(QUANT_CASES["standard"]))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_atens_int4_kernel_agrees_with_the_dequantized_product(method):
    """ATen's int4 kernel on a repacked weight equals the dequantized weight's product
    (float32) within bfloat16's rounding."""
    scheme = scheme_of(method, 4, 64)
    tensors, dequantized = pack_weight(torch.randn(256, 512) * 0.1, scheme)
    layer = _layer(scheme, torch.bfloat16)
    integers = layer.quant.out_major("qweight", tensors["qweight"])
    zeros = layer.quant.out_major("qzeros", tensors["qzeros"])
    scales = layer.quant.out_major("scales", tensors["scales"]).float()
    int4 = AtenInt4.pack(integers, zeros, scales, 64)
    x = torch.randn(5, 512)
    got = int4.matmul(x.to(torch.bfloat16)).float()
    want = x.to(torch.bfloat16).float() @ dequantized.t()
    assert torch.allclose(got, want, atol=0.05, rtol=0.02), (got - want).abs().max()


@pytest.mark.parametrize("group", [32, 128, 512])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_our_int4_kernel_agrees_with_the_dequantized_product(group, rows):
    """csrc/cpu_int4.cpp (AVX512-BF16): every row tile (4, then the rest) and group size,
    against the dequantized weight's product (float32) within bfloat16's rounding."""
    if not NibbleStrips.serves(torch.Size([96, 512]), group):
        pytest.skip("radixserve's int4 kernel needs an AVX512-BF16 build of the CPU kernels")
    scheme = scheme_of("gptq", 4, group)
    tensors, dequantized = pack_weight(torch.randn(96, 512) * 0.1, scheme)
    method = ModelContext.create(get_registry(), _query(scheme), torch.device("cpu"), quantization="gptq").quant
    integers, zeros = method.out_major("qweight", tensors["qweight"]), method.out_major("qzeros", tensors["qzeros"])
    kernel = NibbleStrips.pack(integers, zeros, method.out_major("scales", tensors["scales"]).float(), group)
    x = torch.randn(rows, 512).to(torch.bfloat16)
    got = kernel.matmul(x).float()
    want = x.float() @ dequantized.t()
    assert torch.allclose(got, want, atol=0.05, rtol=0.02), (got - want).abs().max()


@pytest.mark.parametrize("bits", [5, 6, 8])
def test_our_int8_kernel_agrees_with_the_dequantized_product(bits):
    """5- to 8-bit weights (GPTQ-Int8, Q8_0, Q6_K, Q5_K) on csrc/cpu_int4.cpp's byte path,
    fractional zero points included, equal the dequantized weight's product within
    bfloat16's rounding, at 1, 5 (a tile of four, then one) and 9 rows (four strips a tile)."""
    kernel = ByteStrips if bits == 8 else SevenBitStrips
    if not kernel.serves(torch.Size([96, 512]), 32):
        pytest.skip(f"{kernel.name} is not built for this CPU")
    gen = torch.Generator().manual_seed(bits)
    qweight = torch.randint(0, 2**bits, (96, 512), generator=gen).to(torch.uint8)
    zeros = torch.rand(96, 16, generator=gen) * 2**bits
    scales = torch.rand(96, 16, generator=gen) * 0.01
    packed = kernel.pack(qweight, zeros, scales, 32)
    for rows in (1, 5, 9):
        x = torch.randn(rows, 512, generator=gen).to(torch.bfloat16)
        got = packed.matmul(x).float()
        want = x.float() @ dequantize(qweight, zeros, scales).t()
        assert torch.allclose(got, want, atol=0.05, rtol=0.02), (got - want).abs().max()


@pytest.mark.parametrize(("bits", "sym"), [(4, False), (4, True), (6, False), (8, True)])
def test_our_float32_kernel_computes_the_checkpoints_exact_weights(bits, sym):
    """csrc/cpu_int4.cpp's float32 path (AVX2, FMA, F16C) equals the dequantized weight's
    product to float32's rounding, at 1, 2, 3, 5 and 9 rows (every row tile): figures
    exact in float16 are kept so (GPTQ's scales are float16), others in float32, and a
    4-bit symmetric layer's zero offsets are not stored at all."""
    kernel = FloatNibbleStrips if bits == 4 else FloatByteStrips
    if not kernel.serves(torch.Size([96, 512]), 32):
        pytest.skip(f"{kernel.name} is not built for this CPU")
    gen = torch.Generator().manual_seed(bits)
    qweight = torch.randint(0, 2**bits, (96, 512), generator=gen).to(torch.uint8)
    scales = (torch.rand(96, 16, generator=gen) * 0.01).half().float()  # as GPTQ stores them
    zeros = torch.full((96, 16), float(2 ** (bits - 1))) if sym else torch.randint(0, 2**bits, (96, 16)).float()
    packed = kernel.pack(qweight, zeros, scales, 32)
    assert packed.scales.dtype == torch.float16
    if sym:  # 4 bits: (8 - 8) * scale, none stored; 8 bits: -128 * scale, exact in float16
        assert packed.offsets.numel() == 0 if bits == 4 else packed.offsets.dtype == torch.float16
    else:  # (8 - zero) * scale needs more than float16's 11 bits
        assert packed.offsets.dtype == torch.float32
    for rows in (1, 2, 3, 5, 9):
        x = torch.randn(rows, 512, generator=gen)
        want = x.double() @ dequantize(qweight, zeros, scales).double().t()
        assert torch.allclose(packed.matmul(x).double(), want, atol=1e-4, rtol=1e-5), rows


DECISION = """
import logging, torch
from radixserve.kernels import KernelQuery
from radixserve.layers import RowParallelLinear
from radixserve.layers.context import ModelContext
from radixserve.registry import get_registry
from radixserve.testing.quantized_checkpoints import pack_weight, scheme_of
logging.basicConfig(level=logging.INFO, format="%(message)s")
scheme = scheme_of("gptq", 4, 128)
query = KernelQuery(device="cpu", dtype=torch.bfloat16, quantization="gptq", quantized_checkpoint=scheme)
# Backends of plain torch: this process then compiles no CPU kernels (it has none that take int4).
torch_backends = dict(attention="torch_native", elementwise="torch_native", gemm="torch")
ctx = ModelContext.create(get_registry(), query, torch.device("cpu"), quantization="gptq", **torch_backends)
layer = RowParallelLinear(1024, 1024, ctx)
tensors, _ = pack_weight(torch.randn(1024, 1024) * 0.1, scheme)
for name, tensor in tensors.items():
    getattr(layer, name).weight_loader(getattr(layer, name), tensor)
layer.quant.process_weights_after_loading(layer)
print("path:", "int4" if hasattr(layer, "int4") else "dense")
"""


def test_without_vector_units_the_weights_are_dequantized_at_load():
    """ATen's scalar int4 path (``ATEN_CPU_CAPABILITY=default``, as on a CPU without AVX2)
    is many times slower than a dense GEMM: timed at load, the layer goes dense, saying why."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", DECISION], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "path: dense" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "loading the CPU kernels" not in out.stderr  # a build without vector units has no int4 kernel
    assert re.search(
        r"gptq: a 1024 x 1024 layer at 1 / 16 rows: dequantized \(\w+\) [\d.]+ / [\d.]+ ms, "
        r"aten int4 [\d.]+ / [\d.]+ ms; "
        r"using dequantized",
        out.stderr,
    ), out.stderr[-2000:]


def _ct(ignore: list[str] | None = None, **group: object) -> dict:
    """A compressed-tensors quantization_config (W4A16 by groups of 32) with ``group`` changed."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    config_group = {"targets": ["Linear"], "weights": weights, "format": "pack-quantized", **group}
    return {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": config_group},
        "ignore": ignore or ["lm_head"],
    }


_W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}  # W8A8's weights
_A8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}  # and activations


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"quant_method": "mxfp4"}, r"quant_method: 'mxfp4' is not served; served: gptq, awq, compressed-tensors, fp8"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, r"quantization_config.weight_block_size: unset"),
        ({"quant_method": "gptq", "bits": 3}, r"quantization_config.bits: 3-bit gptq is not served; served: 4, 8"),
        ({"quant_method": "awq", "bits": 8}, r"quantization_config.bits: 8-bit awq is not served; served: 4"),
        ({"quant_method": "awq", "w_bit": 4, "version": "gemv"}, r"quantization_config.version: AWQ's 'gemv'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 12}, r"quantization_config.group_size: 12"),
        (_ct(input_activations={"num_bits": 8, "type": "int"}), r"group_0.input_activations: quantized activations"),
        (_ct(format="naive-quantized"), r"quantization_config.format: 'naive-quantized' is not served"),
        (_ct(format="float-quantized"), r"group_0.weights: 4-bit 'int' weights, dynamic None in float-quantized"),
        (_ct(format="int-quantized", weights=_W8 | {"symmetric": False}), r"weights.symmetric: false is not served"),
        (_ct(format="int-quantized", weights=_W8 | {"strategy": "group"}), r"weights.strategy: 'group' is not served"),
        (
            _ct(format="int-quantized", weights=_W8, input_activations=_A8 | {"strategy": "tensor"}),
            r"group_0.input_activations: 8-bit 'int', strategy 'tensor', dynamic True",
        ),
        (
            _ct(format="int-quantized", weights=_W8, input_activations=_A8 | {"type": "float"}),
            r"input_activations: 8-bit 'float'.* \(served: 8-bit int, symmetric",
        ),
        (
            _ct(ignore=["lm_head", "re:.*self_attn.*"]),
            r"ignore: \['re:.\*self_attn.\*'\] \(served: the LM head and MoE routers alone left unquantized\)",
        ),
        (_ct(weights={"num_bits": 2, "strategy": "group", "group_size": 32}), r"weights.num_bits: 2-bit"),
    ],
)
def test_what_is_not_served_is_refused_naming_the_field(fields, message):
    config = PretrainedConfig(quantization_config=fields)
    with pytest.raises(ValueError, match=message):
        checkpoint_quantization(config)


W8A8_FORMATS = {
    "int8-by-token": dict(weight_type="int", activations="token", group=-1),
    "int8-static": dict(weight_type="int", activations="tensor", group=0),
    "fp8-dynamic": dict(weight_type="float", activations="token", group=-1),
    "fp8-static": dict(weight_type="float", activations="tensor", group=0),
    "int8-weights-alone": dict(weight_type="int", activations=None, group=-1),
}


@pytest.mark.parametrize("name", list(W8A8_FORMATS))
def test_compressed_tensors_8bit_agrees_with_hf_running_the_checkpoint(name, tiny_llama_dir, tmp_path):
    """llm-compressor's W8A8 presets (int8 weights by channel with int8 activations by
    token; FP8 by tensor with static activation scales; FP8-dynamic) as compressed-tensors
    writes them, against HF transformers running the same checkpoint through
    compressed-tensors (which rounds the activations as the checkpoint says): every
    layer's input rounded to 8 bits makes the model chaotic (a throwaway check while
    writing this test: a relative change of 1e-6 in the embeddings moved HF's own
    logprobs by 0.4 on these random weights), so the
    check is teacher-forced top-1 agreement in float32 along HF's greedy tokens, which
    a misread scale or a shard's scale on the wrong rows brings near 0; each layer's
    exact arithmetic is the kit's (test_the_8bit_method_passes_the_quantization_kit).
    Weights alone (W8A16) are smooth: the greedy tokens equal HF's on the dequantized
    weights."""
    spec = W8A8_FORMATS[name]
    out, reference_dir = tmp_path / "q", tmp_path / "r"
    write_quantized(tiny_llama_dir, out, reference_dir, "compressed-tensors-w8a8", bits=8, sym=True, **spec)
    assert checkpoint_quantization(load_config(out)).activations == spec["activations"]
    if spec["activations"] is None:
        hf = hf_reference(reference_dir, [5, 17, 33], new_tokens=16)
        check_greedy_matches_hf(Reference(out, hf.prompts, hf.new_tokens, hf.hf), "radix-cache")
        return
    hf = hf_reference(out, [9, 21, 40], new_tokens=24)
    agreement = teacher_forced_agreement(Reference(out, hf.prompts, hf.new_tokens, hf.hf), "float32")
    assert agreement >= 0.9, f"teacher-forced top-1 agreement with HF {agreement:.3f}"


@pytest.mark.parametrize("name", [n for n, spec in W8A8_FORMATS.items() if spec["activations"]])
def test_the_8bit_method_passes_the_quantization_kit(name):
    """Each layer against compressed-tensors' arithmetic in float32: the activations
    rounded per token (largest magnitude over 127.5 or 448) or by the stored scale,
    times the dequantized weight."""
    spec = W8A8_FORMATS[name]
    scheme = scheme_of(
        "compressed-tensors-w8a8", 8, spec["group"], True, **{k: spec[k] for k in ("weight_type", "activations")}
    )
    report = check_quantization_method("compressed-tensors-w8a8", dtypes=(torch.float32,), checkpoint=scheme)
    report.raise_for_failures(min_run=len(QUANT_CASES["standard"]))


MOE_FORMATS = {
    "mixtral-gptq-act-order": ("mixtral", dict(method="gptq", bits=4, group=32, desc_act=True)),
    "qwen3_moe-awq": ("qwen3_moe", dict(method="awq", bits=4, group=32)),
    "qwen3_moe-compressed-tensors-w8a16": ("qwen3_moe", dict(method="compressed-tensors", bits=8, group=-1, sym=True)),
    "mixtral-fp8-blocks": ("mixtral", dict(method="fp8_block", bits=8, group=32)),
}


@pytest.mark.parametrize("name", list(MOE_FORMATS))
def test_a_quantized_moe_gives_hfs_greedy_tokens_on_the_dequantized_weights(name, tiny_model_factory, tmp_path):
    """Mixtral and Qwen3-MoE with every expert quantized (per expert, as the formats' tools
    write MoE checkpoints; routers left float): their experts are dequantized at load and
    the greedy tokens equal HF's on the dequantized weights."""
    arch, spec = MOE_FORMATS[name]
    out, reference_dir = tmp_path / "q", tmp_path / "r"
    write_quantized(tiny_model_factory(arch=arch), out, reference_dir, **spec)
    hf = hf_reference(reference_dir, [5, 17, 33], new_tokens=16)
    check_greedy_matches_hf(Reference(out, hf.prompts, hf.new_tokens, hf.hf), "radix-cache")


def test_act_order_is_refused_where_tensor_parallelism_splits_a_layers_inputs():
    scheme = QuantizedCheckpoint("gptq", 4, 32, symmetric=False, desc_act=True, zero_offset=1)
    query = KernelQuery(device="cpu", dtype=torch.float32, quantization="gptq", quantized_checkpoint=scheme)
    ctx = ModelContext.create(get_registry(), query, torch.device("cpu"), quantization="gptq", tp_size=2)
    layer = RowParallelLinear(128, 64, ctx)  # each rank holds 64 of the 128 inputs
    g_idx = torch.randperm(128).to(torch.int32) // 32
    with pytest.raises(ValueError, match=r"act-order \(quantization_config.desc_act\) with tensor parallelism"):
        layer.g_idx.weight_loader(layer.g_idx, g_idx)


class _ZeroPointsAsStored(GPTQ):
    """Reads GPTQ's own format without adding one to its zero points."""

    def out_major(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        if name == "qzeros":
            return unpack_columns(loaded, self.scheme.bits).t()
        return super().out_major(name, loaded)


def test_the_kit_fails_a_method_that_misreads_the_zero_points():
    report = check_quantization_method(_ZeroPointsAsStored, dtypes=(torch.float32,), checkpoint=scheme_of("gptq"))
    assert len(report.failures) == len(QUANT_CASES["standard"]), str(report)


KIT_UNDER_CAPS = """
import torch
from radixserve.testing import check_quantization_method
from radixserve.testing.conformance import QUANT_CASES
from radixserve.testing.quantized_checkpoints import scheme_of
schemes = [scheme_of("gptq"), scheme_of("awq"), scheme_of("gguf", 4, 32, False)]
schemes.append(scheme_of("compressed-tensors-w8a8", 8, -1, True, activations="token"))
for scheme in schemes:
    report = check_quantization_method(scheme.method, dtypes=(torch.float32, torch.bfloat16), checkpoint=scheme)
    report.raise_for_failures(min_run=2 * len(QUANT_CASES["standard"]))
print("passed", torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the AVX2 caps are x86-64's")
def test_the_kit_passes_under_the_avx2_caps():
    """What an AVX2-only CPU runs (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``):
    in bfloat16 ATen's int4 kernel or the dequantized weight, whichever is faster; in
    float32 our kernel's float32 path or the dequantized weight (GPTQ, AWQ, GGUF's Q4_K
    and Q4_1 with fractional zero points), and W8A8's rounded activations on the
    dequantized weight."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", KIT_UNDER_CAPS], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "passed AVX2" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


# ---- GGUF files (llama.cpp's) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def k_quant_llama_dir(tiny_model_factory) -> Path:
    """A tiny Llama whose rows fill k-quant blocks (256 inputs): hidden 256, ffn 512, head dim 64."""
    return tiny_model_factory(arch="llama", hidden_size=256, intermediate_size=512)


# Each type's reading is checked against the gguf package below; served whole: the plain
# blocks of 4 and 8 bits, a float file, and the k-quant mix (Q4_K's minima, Q6_K's groups of 16).
@pytest.mark.parametrize("linear_type", ["Q4_0", "Q8_0", "F16", "Q4_K_M"])
def test_a_gguf_file_gives_the_greedy_tokens_hf_reads_from_it(linear_type, request, tmp_path):
    """``--model FILE.gguf --tokenizer-path DIR``: the file as llama.cpp's converter writes
    it (q and k rows permuted, projections quantized by the gguf package, or packed as
    k-quants; ``Q4_K_M``: Q4_K and Q6_K mixed as llama.cpp's recipe mixes them, the
    embeddings Q4_K; the head typed as llama.cpp's quantizer types it, here Q8_0 but for
    Q4_K_M's Q6_K and F16's F16, and served quantized); HF transformers reading the same file
    (dequantizing it) is the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = request.getfixturevalue("k_quant_llama_dir" if "_K" in linear_type else "tiny_llama_dir")
    gguf_file = tmp_path / f"tiny-{linear_type}.gguf"
    write_gguf(model_dir, gguf_file, linear_type)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_file.name, dtype=torch.float32)
    # transformers will not save a model it read from GGUF: its weights and config, as read, by hand
    (tmp_path / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "hf" / "model.safetensors")
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    reference = hf_reference(tmp_path / "hf", [9, 21], new_tokens=16)
    # Q8_0's file is served with its own tokenizer (no --tokenizer-path): the GGUF's vocabulary
    # (llama.cpp's gpt2 tokens and merges), read through transformers, tokenizes as the HF
    # tokenizer it was written from.
    own_tokenizer = linear_type == "Q8_0"
    flags = (
        "--dtype",
        "float32",
        "--skip-server-warmup",
        *(() if own_tokenizer else ("--tokenizer-path", str(model_dir))),
    )
    with ServerProcess("--model", str(gguf_file), *flags) as server:
        server.wait_ready()
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [str(gguf_file)]  # served under the file's path
        assert_served_greedy_tokens(server, reference)
        if own_tokenizer:
            text = "the quick brown fox, and a <|im_end|> or two"
            want = AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)
            body = {"model": str(gguf_file), "prompt": text, "add_special_tokens": False}
            assert httpx.post(server.url + "/tokenize", json=body).json()["tokens"] == want
        if linear_type == "F16":
            assert "quantization backend: none" in server.log  # float projections: a dense model
        else:
            assert "quantization backend: gguf (the checkpoint's)" in server.log


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_each_gguf_type_reads_as_the_gguf_package_dequantizes_it(kind):
    """Every block type read as (q - zero) * scale equals the gguf package's own
    dequantization of the same bytes, at the type's group size and at 16; a group whose
    scale is 0 (all its weights equal) included."""
    import gguf

    from radixserve.checkpoints.gguf import BLOCK_TYPES, read_blocks
    from radixserve.testing.quantized_checkpoints import quantize_gguf

    weight = torch.randn(8, 512, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[0, :32] = 0.01
    data = quantize_gguf(weight, kind)
    want = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).copy()).float()
    assert (want - weight).abs().max() < 0.02  # a valid block of that type: near the weight it stands for
    for group in sorted({BLOCK_TYPES[kind][1], 16}):
        blocks = read_blocks(data, kind, group)
        got = (blocks["qweight"].float().view(8, -1, group) - blocks["qzeros"][..., None]) * blocks["scales"][..., None]
        assert torch.allclose(got.view(8, -1), want, atol=1e-7, rtol=0), (kind, group)


@pytest.mark.parametrize("kernel", [NibbleStrips, AtenInt4])
def test_the_int4_kernels_compute_k_quant_layers_read_at_16(kernel):
    """A Q4_K layer read at 16-input groups (the file also holds Q6_K) is coarsened back to
    its 32-input groups by the gguf method, and the int4 kernels, given its fractional zero
    points (Q4_K's minima), equal the dequantized product within bfloat16's rounding."""
    import gguf

    from radixserve.checkpoints.gguf import read_blocks
    from radixserve.testing.quantized_checkpoints import quantize_gguf

    if not kernel.serves(torch.Size([96, 512]), 32):
        pytest.skip(f"{kernel.name} is not built for this CPU")
    data = quantize_gguf(torch.randn(96, 512, generator=torch.Generator().manual_seed(1)) * 0.1, "Q4_K")
    dequantized = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_K).copy()).float()
    blocks = read_blocks(data, "Q4_K", 16)
    scheme = scheme_of("gguf", 6, 16)
    method = ModelContext.create(get_registry(), _query(scheme), torch.device("cpu"), quantization="gguf").quant
    zeros, scales = method.regroup(blocks["qzeros"], blocks["scales"])
    assert scales.shape == (96, 16) and method.layer_bits(blocks["qweight"]) == 4
    x = torch.randn(3, 512).to(torch.bfloat16)
    got = kernel.pack(blocks["qweight"], zeros, scales, 32).matmul(x).float()
    want = x.float() @ dequantized.t()
    assert torch.allclose(got, want, atol=0.05, rtol=0.02), (got - want).abs().max()


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0"])
@pytest.mark.parametrize("vocab", [301, 319])
def test_a_quantized_output_head_serves_each_ranks_vocabulary_rows_from_the_files_integers(kind, vocab):
    """llama.cpp's quantizer stores the output head Q6_K (Q8_0 in a Q8_0 file): the gguf
    method loads it as stored, each tensor-parallel rank its rows of the vocabulary (the
    last rank's padded with a zero row), and each rank's logits are those of the head the
    gguf package dequantizes. 151 rows a rank are not whole strips of the byte kernel
    (dequantized at load); 160 are (the kernel where it times faster)."""
    import dataclasses

    import gguf

    from radixserve.checkpoints.gguf import BLOCK_TYPES, read_blocks
    from radixserve.layers import ParallelLMHead
    from radixserve.testing.quantized_checkpoints import quantize_gguf

    hidden = 256
    data = quantize_gguf(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(3)) * 0.1, kind)
    dense = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).copy()).float()
    blocks = read_blocks(data, kind, 16)
    scheme = dataclasses.replace(scheme_of("gguf", BLOCK_TYPES[kind][0], 16), lm_head=True)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(4))
    logits = []
    for rank in range(2):
        query, cpu = _query(scheme, torch.float32), torch.device("cpu")
        ctx = ModelContext.create(get_registry(), query, cpu, quantization="gguf", tp_rank=rank, tp_size=2)
        head = ParallelLMHead(vocab, hidden, ctx)
        params = dict(head.named_parameters())
        assert sorted(params) == ["qweight", "qzeros", "scales"]  # the file's tensors, no float weight
        for name, param in params.items():
            param.weight_loader(param, blocks[name])  # type: ignore[attr-defined]
        head.process_weights_after_loading()
        logits.append(head.quant.apply(head, x, None))
    got = torch.cat(logits, -1)
    assert got.shape == (3, vocab + 1) and torch.equal(got[:, vocab:], torch.zeros(3, 1))
    want = x.double() @ dense.double().t()
    assert torch.allclose(got[:, :vocab].double(), want, atol=1e-4, rtol=1e-4), (got[:, :vocab] - want).abs().max()


def test_a_quantized_head_is_not_tied_to_the_embeddings():
    from radixserve.layers import ParallelLMHead, VocabParallelEmbedding

    scheme = QuantizedCheckpoint("gguf", 8, 32, symmetric=False, lm_head=True)
    ctx = ModelContext.create(get_registry(), _query(scheme, torch.float32), torch.device("cpu"), quantization="gguf")
    head = ParallelLMHead(64, 32, ctx)
    with pytest.raises(ValueError, match="lm_head_type"):
        head.tie_to(VocabParallelEmbedding(64, 32, ctx))


def test_a_gguf_file_of_another_type_is_refused_naming_it(k_quant_llama_dir, tmp_path):
    import gguf

    from radixserve.checkpoints.gguf import linear_types

    gguf_file = tmp_path / "tiny-tq2.gguf"
    write_gguf(k_quant_llama_dir, gguf_file, "TQ2_0")
    with pytest.raises(ValueError, match=r"projections are TQ2_0; served: any of Q4_0, Q4_1, .*Q6_K, or all float"):
        linear_types(gguf.GGUFReader(str(gguf_file)))


def test_the_engine_opens_a_gguf_file_as_sglang_spells_it(tiny_llama_dir, tmp_path):
    """``Engine(model_path="m.gguf", tokenizer_path=DIR)`` (the CPU's default dtype: 4-bit
    layers on an int4 kernel where the CPU has one) generates, and a second Engine on
    the same file reuses the directory materialized for it, with the same greedy tokens."""
    gguf_file = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama_dir, gguf_file, "Q4_0")
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    prompt = list(range(20, 60))
    runs = []
    for _ in range(2):
        with Engine(model_path=str(gguf_file), tokenizer_path=str(tiny_llama_dir), log_level="warning") as engine:
            runs.append((engine.model_path, engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]))
    (first_dir, first), (second_dir, second) = runs
    assert first_dir == second_dir and Path(first_dir).parent.name == "gguf"  # materialized once, then reused
    assert first == second and len(first) == 8
