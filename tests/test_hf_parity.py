"""Greedy generation through the scheduler equals HF transformers `generate`
token for token, for every supported architecture; logprobs agree in fp32."""

from __future__ import annotations

import pytest
from generation_utils import generate, hf_greedy, make_scheduler, mixed_prompts

from radixserve.messages import FinishReason
from radixserve.testing.tiny_models import llama3_rope_scaling

NEW_TOKENS = 64

ARCHITECTURES = {
    "llama": dict(arch="llama"),
    "llama3-rope-tied": dict(arch="llama", rope_scaling=llama3_rope_scaling(), tie_word_embeddings=True, seed=1),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=32),
    "mistral": dict(arch="mistral"),
    "qwen3_moe": dict(arch="qwen3_moe"),
    "llama-sharded": dict(arch="llama", shard=True, seed=2),
}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_matches_hf(tiny_model_factory, name):
    model_dir = tiny_model_factory(**ARCHITECTURES[name])
    scheduler = make_scheduler(model_dir)
    # One prompt alone, then a batch of mixed lengths (the same prompt included).
    prompts = mixed_prompts(scheduler.runner.vocab_size, [7, 1, 23, 40, 12], seed=3)
    alone = generate(scheduler, prompts[:1], max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logprob=True)
    batch = generate(scheduler, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logprob=True)
    assert alone[0].output_ids == batch[0].output_ids
    for prompt, result in zip(prompts, batch):
        ref_ids, ref_logprobs = hf_greedy(model_dir, prompt, NEW_TOKENS)
        assert result.output_ids == ref_ids
        assert result.finish_reason == FinishReason("length")
        worst = max(abs(a - b) for a, b in zip(result.logprobs, ref_logprobs))
        assert worst < 1e-3, f"{name}: chosen-token logprob differs from HF by {worst}"
