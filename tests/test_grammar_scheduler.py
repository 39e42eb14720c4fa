"""Structured output inside the scheduler (in-process): a constrained request's
tokens are the same with and without overlap scheduling and after retraction
(its matcher stays valid: retraction digests the outstanding steps first, and
the request resumes from prompt + output without sampling them again), and the
same whichever elementwise backend applies the mask."""

from __future__ import annotations

import logging
import re

import pytest
from generation_utils import make_scheduler, mixed_prompts, run, submit
from transformers import AutoTokenizer

from radixserve.kernels.elementwise import apply_token_bitmask
from radixserve.structured_output.backend import GrammarSpec

REGEX = "[a-z]{6,10}( [a-z]{6,10}){2,3}"
SPEC = GrammarSpec("regex", REGEX)


def _generate(scheduler, prompts):  # type: ignore[no-untyped-def]
    """Three unconstrained requests, then three constrained ones (the newest: retraction takes
    them first); the results, constrained first, and the constrained ids."""
    free = [submit(scheduler, p, temperature=0.0, max_new_tokens=30, ignore_eos=True) for p in prompts[1::2]]
    constrained = [submit(scheduler, p, temperature=0.0, max_new_tokens=60, grammar=SPEC) for p in prompts[::2]]
    results = run(scheduler)
    return [results[r] for r in constrained + free], constrained


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_constrained_tokens_survive_overlap_and_retraction(tiny_llama_dir, overlap, caplog):  # type: ignore[no-untyped-def]
    prompts = mixed_prompts(512, [30, 25, 20, 35, 28, 22], seed=1)
    reference, _ = _generate(make_scheduler(tiny_llama_dir, disable_overlap_schedule=True), prompts)
    scheduler = make_scheduler(
        tiny_llama_dir,
        max_total_tokens=110,
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.05,
        disable_overlap_schedule=not overlap,
    )
    with caplog.at_level(logging.INFO, logger="radixserve.runtime.scheduling.scheduler"):
        results, constrained = _generate(scheduler, prompts)
    retracted = set(re.findall(r"retracted (\S+) after", caplog.text))
    assert retracted & set(constrained), "a constrained request was meant to be retracted"
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for r in results[:3]:
        assert r.finish_reason.type == "stop"
        assert re.fullmatch(REGEX, tokenizer.decode(r.output_ids, skip_special_tokens=True))
    assert scheduler.grammars.active == 0 and not scheduler.grammars  # every matcher released


def test_the_mask_is_the_elementwise_backends_kernel_and_constrains_as_the_torch_code(tiny_llama_dir):  # type: ignore[no-untyped-def]
    """The sampler masks with the model's elementwise backend (``cpu_fused``: its C++
    kernel); a scheduler whose sampler is given the torch code instead, the model
    otherwise the same, samples the same tokens."""
    prompts = mixed_prompts(512, [30, 25, 20, 35, 28, 22], seed=1)
    outputs = []
    for masking in ("kernel", "torch"):
        scheduler = make_scheduler(tiny_llama_dir, elementwise_backend="cpu_fused")
        assert scheduler.sampler.mask_logits == scheduler.runner.elementwise.apply_token_bitmask
        if masking == "torch":
            scheduler.sampler.mask_logits = apply_token_bitmask
        results, _ = _generate(scheduler, prompts)
        outputs.append([r.output_ids for r in results])
    assert outputs[0] == outputs[1]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert all(re.fullmatch(REGEX, tokenizer.decode(ids, skip_special_tokens=True)) for ids in outputs[0][:3])
