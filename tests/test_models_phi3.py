"""Phi-3 against HF transformers on a tiny random-weight model with LongRoPE and
a sliding window: greedy generation and logprobs through the scheduler (alone,
ragged batches, radix cache on and off, chunked prefill) with both LongRoPE
sets (the long factors for prompts longer than
``original_max_position_embeddings``, the short factors for sequences within
it) with every request crossing the window; bfloat16 teacher-forced agreement;
the LongRoPE tables against HF's rotary embedding; fused checkpoint projections
split across tensor-parallel ranks; Phi-4-mini's partial rotary (a quarter of
each head left unturned) with LongRoPE. tests/test_longrope.py has sequences
that grow past the original context and the prefix cache's namespaces."""

from __future__ import annotations

import pytest
import torch
from helpers_models import SCHEDULER_CONFIGS, Reference, bf16_agreement, check_greedy_matches_hf, hf_reference

from radixserve.checkpoints.loader import load_config, model_kernel_query
from radixserve.kernels import KernelQuery
from radixserve.layers import MergedColumnParallelLinear, PagedAttention, QKVParallelLinear, RotaryEmbedding
from radixserve.layers.context import ModelContext
from radixserve.models import Phi3ForCausalLM
from radixserve.registry import get_registry
from radixserve.testing.tiny_models import longrope_scaling, tiny_config

ORIGINAL_CONTEXT = 64
WINDOW = 48
# max_position_embeddings 256 = 4 x the original context: attention factor sqrt(1 + ln 4 / ln 64).
SPEC = dict(
    arch="phi3",
    max_position_embeddings=256,
    rope_scaling=longrope_scaling(),
    original_max_position_embeddings=ORIGINAL_CONTEXT,
    sliding_window=WINDOW,
)
# The long factors: prompts past the original context, as HF runs them all with
# the long factors from the first call (layers/rotary.py).
LONG_PROMPTS = [65, 70, 97, 66, 81]
# The short factors: prompt + 24 new tokens within the original context.
SHORT_PROMPTS, SHORT_NEW_TOKENS = [7, 1, 23, 40, 12], 24
# Phi-4-mini's rotary: 3/4 of each head's 16 dimensions turn, LongRoPE over those 12.
PARTIAL = dict(SPEC, rope_scaling=longrope_scaling(12), partial_rotary_factor=0.75, sliding_window=None)
BF16_AGREEMENT = 0.95  # teacher-forced greedy agreement with HF in bfloat16, at least (docs/models.md)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory(**SPEC)


@pytest.fixture(scope="module")
def long_reference(model_dir) -> Reference:
    return hf_reference(model_dir, LONG_PROMPTS)


def test_config_is_what_the_tests_claim(model_dir):
    config = load_config(model_dir)
    assert Phi3ForCausalLM.model_facts(config).sliding_window == WINDOW
    assert config.rope_parameters["rope_type"] == "longrope"
    assert config.rope_parameters["original_max_position_embeddings"] == ORIGINAL_CONTEXT
    assert all(WINDOW < ORIGINAL_CONTEXT < n for n in LONG_PROMPTS)
    assert all(n + SHORT_NEW_TOKENS <= ORIGINAL_CONTEXT for n in SHORT_PROMPTS)
    assert max(SHORT_PROMPTS) + SHORT_NEW_TOKENS > WINDOW


@pytest.mark.parametrize("config", list(SCHEDULER_CONFIGS))
def test_greedy_matches_hf_long_factors(long_reference: Reference, config: str):
    check_greedy_matches_hf(long_reference, config)


def test_greedy_matches_hf_short_factors(model_dir):
    reference = hf_reference(model_dir, SHORT_PROMPTS, new_tokens=SHORT_NEW_TOKENS)
    check_greedy_matches_hf(reference, "chunked-prefill")


def test_bf16_teacher_forced_agreement(long_reference: Reference, capsys):
    agreement = bf16_agreement(long_reference)
    with capsys.disabled():
        print(f"\nphi3: bf16 teacher-forced greedy agreement with HF {agreement:.1%}")
    assert agreement >= BF16_AGREEMENT


def test_every_layer_attends_through_the_window(model_dir):
    config = load_config(model_dir)
    registry = get_registry()
    query = model_kernel_query(config, "cpu", torch.float32)
    assert query.sliding_window == WINDOW
    model = Phi3ForCausalLM(config, ModelContext.create(registry, query, CPU))
    assert [m.spec.sliding_window for m in model.modules() if isinstance(m, PagedAttention)] == [WINDOW, WINDOW]


def test_longrope_tables_match_hf():
    """The table holds the short factors' rows, then the long factors' (each with
    the attention factor): HF's numbers exactly, as HF computes them for a call
    within the original context and for one past it."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = tiny_config("phi3", **{k: v for k, v in SPEC.items() if k != "arch"})
    hf = Phi3RotaryEmbedding(config)
    assert hf.attention_scaling > 1.0
    ctx = ModelContext.create(get_registry(), KernelQuery(device="cpu", dtype=torch.float32), CPU)
    table = RotaryEmbedding(config, 16, ctx).cos_sin_cache
    assert table.shape == (2 * 256, 16)
    for first_row, positions in ((0, [0, 1, 30, 63]), (256, [0, 1, 63, 64, 100, 255])):
        ids = torch.tensor(positions)
        ref_cos, ref_sin = hf(torch.zeros(1), ids[None])  # the call's last position picks HF's set
        cos, sin = table[first_row + ids].chunk(2, dim=-1)
        torch.testing.assert_close(torch.cat((cos, cos), -1), ref_cos[0], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat((sin, sin), -1), ref_sin[0], rtol=0, atol=0)
    # The two sets really differ.
    assert not torch.allclose(table[1:64], table[257:320], atol=0.1)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_fused_checkpoint_projections_split_across_ranks(tp_size: int):
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` tensors give each rank the
    same rows as the separate q/k/v (gate/up) tensors do: its query heads, its KV
    heads (replicated when fewer than the ranks), its gate and up rows."""
    hidden, head_dim, heads, kv_heads, inter = 8, 2, 4, 2, 8
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    gate, up = torch.randn(inter, hidden), torch.randn(inter, hidden)
    query = KernelQuery(device="cpu", dtype=torch.float32)
    for rank in range(tp_size):
        ctx = ModelContext.create(get_registry(), query, CPU, tp_rank=rank, tp_size=tp_size)
        fused_qkv, split_qkv = (QKVParallelLinear(hidden, head_dim, heads, kv_heads, ctx) for _ in range(2))
        fused_qkv.weight.weight_loader(fused_qkv.weight, torch.cat([q, k, v]))
        for shard_id, tensor in zip("qkv", (q, k, v), strict=False):
            split_qkv.weight.weight_loader(split_qkv.weight, tensor, shard_id)
        assert torch.equal(fused_qkv.weight, split_qkv.weight)
        local_kv = max(1, kv_heads // tp_size)
        first_kv = rank // (tp_size // kv_heads) if tp_size >= kv_heads else rank * local_kv
        q_local = q[rank * fused_qkv.q_size : (rank + 1) * fused_qkv.q_size]
        k_local = k[first_kv * head_dim : (first_kv + local_kv) * head_dim]
        assert torch.equal(fused_qkv.weight[: fused_qkv.q_size], q_local)
        assert torch.equal(fused_qkv.weight[fused_qkv.q_size : fused_qkv.q_size + fused_qkv.kv_size], k_local)
        fused_mlp, split_mlp = (MergedColumnParallelLinear(hidden, [inter, inter], ctx) for _ in range(2))
        fused_mlp.weight.weight_loader(fused_mlp.weight, torch.cat([gate, up]))
        split_mlp.weight.weight_loader(split_mlp.weight, gate, 0)
        split_mlp.weight.weight_loader(split_mlp.weight, up, 1)
        assert torch.equal(fused_mlp.weight, split_mlp.weight)
        rows = inter // tp_size
        assert torch.equal(fused_mlp.weight[:rows], gate[rank * rows : (rank + 1) * rows])


def test_partial_rotary_greedy_matches_hf(tiny_model_factory):
    model_dir = tiny_model_factory(**PARTIAL)
    assert load_config(model_dir).rope_parameters["partial_rotary_factor"] == 0.75
    check_greedy_matches_hf(hf_reference(model_dir, LONG_PROMPTS[:3]), "chunked-prefill")


def test_partial_rotary_table_is_hfs_over_the_rotary_dimensions():
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = tiny_config("phi3", **{k: v for k, v in PARTIAL.items() if k != "arch"})
    ctx = ModelContext.create(get_registry(), KernelQuery(device="cpu", dtype=torch.float32), CPU)
    table = RotaryEmbedding(config, 16, ctx).cos_sin_cache
    assert table.shape == (2 * 256, 12)  # cos and sin of 6 frequencies: dimensions 12-15 never turn
    ids = torch.tensor([0, 5, 64, 200])
    ref_cos, ref_sin = Phi3RotaryEmbedding(config)(torch.zeros(1), ids[None])  # past the original: long
    cos, sin = table[256 + ids].chunk(2, dim=-1)
    torch.testing.assert_close(torch.cat((cos, cos), -1), ref_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat((sin, sin), -1), ref_sin[0], rtol=0, atol=0)
