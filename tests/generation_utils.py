"""Helpers shared by the generation tests: run prompts through the in-process
Scheduler, and through HuggingFace transformers for reference."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from radixserve.config import ServerArgs
from radixserve.messages import FinishReason, GenerateRequest, TokenOutput
from radixserve.runtime.scheduling.scheduler import Scheduler
from radixserve.sampling.params import SamplingParams

_rids = itertools.count()


@dataclass
class Result:
    output_ids: list[int]
    finish_reason: FinishReason
    cached_tokens: int
    logprobs: list[float]
    input_logprobs: list | None
    input_top_logprobs: list | None
    first_token_step: int | None = None  # the ``run`` step that gave the first token (0: before it)


def make_scheduler(model_dir: Path, registry=None, **server_args: Any) -> Scheduler:
    server_args.setdefault("max_total_tokens", 8192)
    args = ServerArgs(model_path=str(model_dir), **server_args)
    return Scheduler(args, str(model_dir), AutoTokenizer.from_pretrained(model_dir), registry=registry)


def submit(
    scheduler: Scheduler,
    prompt: list[int],
    return_logprob: bool = False,
    logprob_start_len: int = -1,
    top_logprobs_num: int = 0,
    priority: int = 0,
    **params: Any,
) -> str:
    rid = f"r{next(_rids)}"
    scheduler.add_request(
        GenerateRequest(
            rid=rid,
            input_ids=prompt,
            sampling_params=SamplingParams(**params),
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            priority=priority,
        )
    )
    return rid


def run(
    scheduler: Scheduler, check_every_step: bool = True, earlier: list[TokenOutput] | None = None
) -> dict[str, Result]:
    """Step until idle, asserting the memory invariant at every step boundary;
    ``earlier``: outputs of steps the caller ran itself."""
    outputs: list[tuple[int, TokenOutput]] = [(0, out) for out in list(earlier or []) + scheduler.step_outputs()]
    step = 0
    while scheduler.has_work():
        step += 1
        outputs.extend((step, out) for out in scheduler.step())
        if check_every_step:
            assert scheduler.check_memory(), scheduler.stats()
    assert scheduler.check_memory(), scheduler.stats()
    results: dict[str, Result] = {}
    for step, out in outputs:  # a request's messages, in order: its first token, then the rest
        r = results.setdefault(out.rid, Result([], None, 0, [], None, None))
        if out.new_token_ids and not r.output_ids:
            r.first_token_step = step
        r.output_ids += out.new_token_ids
        r.logprobs += [lp for lp, _ in out.output_token_logprobs]
        r.input_logprobs = out.input_token_logprobs if out.input_token_logprobs is not None else r.input_logprobs
        r.input_top_logprobs = out.input_top_logprobs if out.input_top_logprobs is not None else r.input_top_logprobs
        r.finish_reason, r.cached_tokens = out.finish_reason, out.cached_tokens
    assert all(r.finish_reason is not None for r in results.values()), "every request ends with a finish reason"
    return results


def generate(scheduler: Scheduler, prompts: list[list[int]], **params: Any) -> list[Result]:
    params.setdefault("temperature", 0.0)
    rids = [submit(scheduler, p, **params) for p in prompts]
    results = run(scheduler)
    return [results[r] for r in rids]


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF transformers greedy tokens and the log_softmax of each chosen token (fp32)."""
    model = hf_model(str(model_dir))
    # Like ignore_eos: an EOS id that can never be generated (min_new_tokens
    # would instead mask the real EOS out of the distribution).
    never = model.config.vocab_size + 1
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=never,
        pad_token_id=model.generation_config.pad_token_id,
    )
    out = model.generate(
        torch.tensor([prompt]), generation_config=config, output_logits=True, return_dict_in_generate=True
    )
    ids = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, ids, strict=False)]
    return ids, logprobs


_hf_cache: dict[str, Any] = {}


def hf_model(path: str):
    if path not in _hf_cache:
        _hf_cache.clear()
        _hf_cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _hf_cache[path]


def mixed_prompts(vocab_size: int, lengths: list[int], seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """Random prompts (avoiding the special ids at the start of the vocab)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(16, vocab_size, (shared_prefix,), generator=gen).tolist()
    return [prefix + torch.randint(16, vocab_size, (n,), generator=gen).tolist() for n in lengths]


class FailingDecode:
    """A real tokenizer whose ``decode`` fails on any text containing ``bad_id``, as
    a tokenizer bug would: only requests that decode that token hit it."""

    def __init__(self, tokenizer, bad_id: int):
        self._tokenizer, self.bad_id = tokenizer, bad_id

    def decode(self, ids, **kwargs):
        if self.bad_id in ids:
            raise RuntimeError(f"tokenizer failure on token {self.bad_id}")
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def run_in_triton_interpreter(script: str, *args: str) -> dict:
    """Run ``script`` (Python source; ``args`` become ``sys.argv[1:]``) in a child
    process under ``TRITON_INTERPRET=1``, which the Triton kernels read when they are
    defined, with the tests' helpers importable; the JSON of its last output line."""
    tests = str(Path(__file__).resolve().parent)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
