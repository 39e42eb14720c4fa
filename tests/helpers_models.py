"""The checks every architecture gets (tests/test_models_*.py): greedy generation
through the scheduler equals HF ``generate`` (tokens, and logprobs within 1e-3)
for one prompt alone and in a ragged batch, with the radix cache on and off and
with chunked prefill; and, in bfloat16, how often our per-position argmax agrees
with HF's along one fixed token sequence (teacher-forced), which must stay above
a per-architecture threshold (docs/models.md records the figures)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from generation_utils import generate, hf_greedy, make_scheduler, mixed_prompts, run, submit
from transformers import AutoModelForCausalLM

from radixserve.messages import FinishReason

NEW_TOKENS = 64
CHUNK = 8
LOGPROB_TOL = 1e-3
# Backends by priority: no start-up timing of the candidates on each new model's shapes.
PRIORITY = {"backend_selection": "priority"}

# Scheduler settings, each run on one prompt alone and then on the whole ragged batch.
SCHEDULER_CONFIGS = {
    "radix-cache": {},
    "cache-off": {"disable_radix_cache": True},
    "chunked-prefill": {"chunked_prefill_size": CHUNK},
}


@dataclass
class Reference:
    model_dir: Path
    prompts: list[list[int]]
    new_tokens: int
    hf: list[tuple[list[int], list[float]]]  # HF's greedy tokens and their logprobs, new_tokens a prompt


def hf_reference(model_dir: Path, lengths: list[int], new_tokens: int = NEW_TOKENS, seed: int = 3) -> Reference:
    prompts = mixed_prompts(512, lengths, seed=seed)
    return Reference(model_dir, prompts, new_tokens, [hf_greedy(model_dir, p, new_tokens) for p in prompts])


def check_greedy_matches_hf(ref: Reference, config: str, **more_server_args) -> None:
    server_args = {**SCHEDULER_CONFIGS[config], **more_server_args}
    scheduler = make_scheduler(ref.model_dir, **PRIORITY, **server_args)
    alone = _generate(scheduler, ref.prompts[:1], ref.new_tokens)
    batch = _generate(scheduler, ref.prompts, ref.new_tokens)
    assert alone[0].output_ids == batch[0].output_ids
    if "disable_radix_cache" not in server_args:
        assert batch[0].cached_tokens > 0, "the repeated prompt should hit the cache"
    for prompt, result, (ref_ids, ref_logprobs) in zip(ref.prompts, batch, ref.hf, strict=False):
        assert result.output_ids == ref_ids, f"{config}: prompt of {len(prompt)} tokens"
        assert result.finish_reason == FinishReason("length")
        worst = max(abs(a - b) for a, b in zip(result.logprobs, ref_logprobs, strict=False))
        assert worst < LOGPROB_TOL, f"{config}: chosen-token logprob differs from HF by {worst}"
    if "chunked_prefill_size" in server_args:
        for prompt, result in zip(ref.prompts, batch, strict=False):
            assert result.first_token_step >= math.ceil((len(prompt) - result.cached_tokens) / CHUNK)


def _generate(scheduler, prompts: list[list[int]], new_tokens: int) -> list:
    return generate(scheduler, prompts, max_new_tokens=new_tokens, ignore_eos=True, return_logprob=True)


def bf16_agreement(ref: Reference) -> float:
    """Teacher-forced greedy agreement in bfloat16: each reference prompt followed
    by its fp32 greedy continuation goes through HF (one forward) and through our
    scheduler (prefilled with prompt logprobs), both in bfloat16; the fraction of
    positions whose top-1 next token is the same."""
    return teacher_forced_agreement(ref, "bfloat16")


def teacher_forced_agreement(ref: Reference, dtype: str) -> float:
    """``bf16_agreement`` in ``dtype`` (``float32`` for a model whose arithmetic is not
    smooth: one whose activations are rounded to 8 bits, where a difference in the
    seventh digit upstream can flip a rounding and every digit after it)."""
    hf = AutoModelForCausalLM.from_pretrained(ref.model_dir, dtype=getattr(torch, dtype)).eval()
    scheduler = make_scheduler(ref.model_dir, dtype=dtype, **PRIORITY)
    same = total = 0
    for prompt, (continuation, _) in zip(ref.prompts, ref.hf, strict=False):
        sequence = prompt + continuation
        with torch.inference_mode():
            theirs = hf(torch.tensor([sequence])).logits[0, :-1].argmax(-1).tolist()
        rid = submit(
            scheduler, sequence, return_logprob=True, logprob_start_len=0, top_logprobs_num=1, max_new_tokens=1
        )
        tops = run(scheduler)[rid].input_top_logprobs[1:]  # entry i: the top token after sequence[:i + 1]
        ours = [top[0][1] for top in tops]
        assert len(ours) == len(theirs) == len(sequence) - 1
        same += sum(a == b for a, b in zip(ours, theirs, strict=False))
        total += len(ours)
    return same / total
