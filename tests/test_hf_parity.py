"""Greedy generation through the scheduler equals HF transformers `generate`
token for token, for every supported architecture and every way the scheduler
can cut the work: chunked prefill, 16-token pages, the radix cache off, and
requests that end at different steps. Logprobs agree in fp32.

HF's reference is computed once per architecture (64 tokens a prompt); a request
asking for fewer tokens is compared with the start of it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from generation_utils import hf_greedy, make_scheduler, mixed_prompts, run, submit
from transformers import AutoConfig

from radixserve.messages import FinishReason
from radixserve.testing.tiny_models import llama3_rope_scaling

NEW_TOKENS = 64
PROMPT_LENGTHS = [7, 1, 23, 40, 12]
CHUNK = 8  # the 23- and 40-token prompts take 3 and 5 prefill steps
# Backends by priority: no start-up timing of the candidates on each architecture's and
# configuration's shapes (parity, not auto's measurement, is the subject here).
PRIORITY = {"backend_selection": "priority"}

ARCHITECTURES = {
    "llama": dict(arch="llama"),
    "llama3-rope-tied": dict(arch="llama", rope_scaling=llama3_rope_scaling(), tie_word_embeddings=True, seed=1),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=32),
    "mistral": dict(arch="mistral"),
    "qwen3_moe": dict(arch="qwen3_moe"),
    "llama-sharded": dict(arch="llama", shard=True, seed=2),
}


@dataclass(frozen=True)
class Config:
    server_args: dict
    new_tokens: tuple[int, ...] = (NEW_TOKENS,) * len(PROMPT_LENGTHS)  # max_new_tokens, prompt by prompt


CONFIGS = {
    # The scheduler's defaults: page size 1, prompts under the chunk size, radix cache on, all ending together.
    "default": Config({}),
    "chunked-prefill": Config({"chunked_prefill_size": CHUNK}),
    "page-16": Config({"page_size": 16}),
    "cache-off": Config({"disable_radix_cache": True}),
    # Requests leave the batch at different steps while the others decode on.
    "staggered": Config({}, new_tokens=(NEW_TOKENS, 5, 40, 1, 23)),
}


@dataclass
class Reference:
    model_dir: Path
    prompts: list[list[int]]
    hf: list[tuple[list[int], list[float]]]  # HF's greedy tokens and their logprobs, NEW_TOKENS a prompt


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def reference(request: pytest.FixtureRequest, tiny_model_factory) -> Reference:
    model_dir = tiny_model_factory(**ARCHITECTURES[request.param])
    prompts = mixed_prompts(AutoConfig.from_pretrained(model_dir).vocab_size, PROMPT_LENGTHS, seed=3)
    return Reference(model_dir, prompts, [hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_hf(reference: Reference, config: str):
    cfg = CONFIGS[config]
    scheduler = make_scheduler(reference.model_dir, **PRIORITY, **cfg.server_args)
    prompts = reference.prompts
    # One prompt alone, then a batch of mixed lengths with the same prompt again (a cache hit where it caches).
    alone = _generate(scheduler, prompts[:1], cfg.new_tokens[:1])
    batch = _generate(scheduler, prompts, cfg.new_tokens)
    assert alone[0].output_ids == batch[0].output_ids
    for prompt, result, wanted, (ref_ids, ref_logprobs) in zip(
        prompts, batch, cfg.new_tokens, reference.hf, strict=False
    ):
        assert result.output_ids == ref_ids[:wanted], f"prompt of {len(prompt)} tokens"
        assert result.finish_reason == FinishReason("length")
        worst = max(abs(a - b) for a, b in zip(result.logprobs, ref_logprobs, strict=False))
        assert worst < 1e-3, f"{config}: chosen-token logprob differs from HF by {worst}"
    if "chunked_prefill_size" in cfg.server_args:
        # The prompts really were cut: none gives its first token before its last chunk is in.
        for prompt, result in zip(prompts, batch, strict=False):
            assert result.first_token_step >= math.ceil((len(prompt) - result.cached_tokens) / CHUNK)


def _generate(scheduler, prompts: list[list[int]], new_tokens: tuple[int, ...]) -> list:
    rids = [
        submit(scheduler, p, max_new_tokens=n, temperature=0.0, ignore_eos=True, return_logprob=True)
        for p, n in zip(prompts, new_tokens, strict=False)
    ]
    results = run(scheduler)
    return [results[r] for r in rids]
