"""The multi-head latent attention kit: torch_mla (up-projected extend, absorbed
decode) passes it and agrees with the kit's independent dense float64 math, and
deliberately wrong MLA backends fail it, naming the cases."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve.testing import MLA_CASES, check_mla_attention_backend, dense_mla_attention, make_mla_inputs
from radixserve_torch.attention_mla import TorchMLAAttention


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
