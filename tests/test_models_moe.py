"""Mixtral and Qwen2-MoE against HF transformers on tiny random-weight models:
greedy generation and logprobs through the scheduler (alone, ragged batches,
radix cache on and off, chunked prefill), bfloat16 teacher-forced agreement,
both checkpoint layouts of the experts, and the facts backend selection reads."""

from __future__ import annotations

import pytest
import torch
from helpers_models import SCHEDULER_CONFIGS, Reference, bf16_agreement, check_greedy_matches_hf, hf_reference
from transformers import AutoModelForCausalLM

from radixserve.checkpoints.loader import iterate_weights, load_config, model_kernel_query, model_timing_shapes
from radixserve.layers import SparseMoE
from radixserve.layers.context import ModelContext
from radixserve.models import MixtralForCausalLM, Qwen2MoeForCausalLM
from radixserve.registry import get_registry

SPECS = {
    "mixtral": dict(arch="mixtral"),
    # Layer 1 dense (mlp_only_layers); layers 0 and 2 sparse, each with its shared expert.
    "qwen2_moe": dict(arch="qwen2_moe", num_layers=3, mlp_only_layers=[1]),
}
PROMPT_LENGTHS = [7, 1, 23, 40, 12]

# Teacher-forced greedy agreement with HF in bfloat16, at least (measured: docs/models.md).
BF16_AGREEMENT = {"mixtral": 0.95, "qwen2_moe": 0.95}


@pytest.fixture(scope="module", params=list(SPECS))
def reference(request: pytest.FixtureRequest, tiny_model_factory) -> Reference:
    return hf_reference(tiny_model_factory(**SPECS[request.param]), PROMPT_LENGTHS)


@pytest.mark.parametrize("config", list(SCHEDULER_CONFIGS))
def test_greedy_matches_hf(reference: Reference, config: str):
    check_greedy_matches_hf(reference, config)


def test_bf16_teacher_forced_agreement(reference: Reference, capsys):
    arch = load_config(reference.model_dir).model_type
    agreement = bf16_agreement(reference)
    with capsys.disabled():
        print(f"\n{arch}: bf16 teacher-forced greedy agreement with HF {agreement:.1%}")
    assert agreement >= BF16_AGREEMENT[arch]


@pytest.mark.parametrize("arch", list(SPECS))
def test_stacked_and_per_expert_checkpoints_load_alike(arch: str, tiny_model_factory):
    """The hub layout on disk (one tensor per expert projection; Mixtral's
    ``block_sparse_moe.experts.{e}.w1``) and transformers 5's in-memory layout
    (``mlp.experts.gate_up_proj`` stacked) fill every parameter identically."""
    path = tiny_model_factory(with_tokenizer=False, **SPECS[arch])
    names = [name for name, _ in iterate_weights(path)]
    assert any(".experts.0." in name for name in names) and not any("gate_up_proj" in name for name in names)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    in_memory = hf.state_dict()
    assert any(name.endswith(".mlp.experts.gate_up_proj") for name in in_memory)
    config = load_config(path)
    registry = get_registry()
    ctx = ModelContext.create(registry, model_kernel_query(config, "cpu", torch.float32), torch.device("cpu"))
    cls = registry.model_class(config.architectures[0])
    from_disk, from_memory = cls(config, ctx), cls(config, ctx)
    from_disk.load_weights(iterate_weights(path))
    from_memory.load_weights(in_memory.items())
    memory_params = dict(from_memory.named_parameters())
    for name, param in from_disk.named_parameters():
        assert torch.equal(param, memory_params[name]), name
    assert sum(isinstance(m, SparseMoE) for m in from_disk.modules()) == 2  # Qwen2-MoE's layer 1 is dense


def test_facts_for_backend_selection(tiny_model_factory):
    """Backend selection and timing see each MoE model's experts: Mixtral's are
    ``intermediate_size`` wide, Qwen2-MoE's ``moe_intermediate_size``."""
    for arch, cls, width in (("mixtral", MixtralForCausalLM, 128), ("qwen2_moe", Qwen2MoeForCausalLM, 64)):
        config = load_config(tiny_model_factory(with_tokenizer=False, **SPECS[arch]))
        assert get_registry().model_class(config.architectures[0]) is cls
        query = model_kernel_query(config, "cpu", torch.float32, tp_size=2)
        assert (query.num_experts, query.top_k, query.num_heads, query.num_kv_heads) == (4, 2, 2, 1)
        shapes = model_timing_shapes(config, query, tp_size=2, decode_rows=4, prefill_rows=64, context_length=256)
        assert shapes.moe_intermediate_size == width // 2


@pytest.mark.parametrize(
    "arch, overrides, dense_width",
    [
        ("llama", {}, 128),  # every layer's MLP
        ("mixtral", {}, 0),  # experts only: intermediate_size is theirs
        ("qwen3_moe", {}, 0),
        ("qwen2_moe", dict(num_layers=3, mlp_only_layers=[1], shared_expert_intermediate_size=96), 96),  # shared
        ("qwen2_moe", dict(num_layers=3, mlp_only_layers=[0, 1], shared_expert_intermediate_size=96), 128),  # dense
    ],
)
def test_gemm_timing_covers_the_mlps_the_gemm_backend_runs(tiny_model_factory, arch, overrides, dense_width):
    """``auto`` times the GEMM backends on the MLP that most layers run through them: the
    dense MLP, the shared expert beside the routed ones, or none (routed experts are the
    MoE backend's)."""
    config = load_config(tiny_model_factory(with_tokenizer=False, arch=arch, **overrides))
    query = model_kernel_query(config, "cpu", torch.float32, tp_size=2)
    shapes = model_timing_shapes(config, query, tp_size=2, decode_rows=4, prefill_rows=64, context_length=256)
    assert shapes.intermediate_size == dense_width // 2
    projections = {name for name, *_ in shapes.gemm_shapes()}
    assert ("gate_up_proj" in projections) == (dense_width > 0) == ("down_proj" in projections)
