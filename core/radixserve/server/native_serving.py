"""POST /generate, SGLang's native API: ``text`` or ``input_ids`` (one prompt or
a batch), ``sampling_params`` in the runtime's own names, optional logprobs.

The answer is ``{"text", "output_ids", "meta_info"}`` for one prompt, and a flat
list (prompt-major) for a batch or ``n > 1``. Streamed chunks carry the text so
far, as SGLang's do (a client prints ``text[len(previous):]``), plus ``index``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator
from typing import Any, cast

from fastapi import Request
from fastapi.responses import StreamingResponse

from radixserve.sampling.params import SamplingParams
from radixserve.server.errors import APIError
from radixserve.server.lora import ServedAdapters
from radixserve.server.protocol import GenerateRequestBody, bootstrap_of
from radixserve.server.streaming import (
    EventStreamResponse,
    Tagged,
    cancel_on_disconnect,
    collect,
    first_and_rest,
    runtime_errors,
    start_generation,
)
from radixserve.server.tokenizer_manager import GenerateInput, TokenizerManager
from radixserve.structured_output.request_specs import SAMPLING_PARAMS_FIELDS, ConstraintError, take_sampling_grammar

# SGLang's names of the structured output constraints stand for the runtime's ``grammar``.
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"grammar"} | set(
    SAMPLING_PARAMS_FIELDS
)
# The runtime names sampling parameters as they are; the API reports them where the request has them.
RENAMES = {name: f"sampling_params.{name}" for name in _SAMPLING_FIELDS}
_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs")


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """A value given once for all prompts, or as a list with one per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise APIError(400, f"{name}: {len(value)} given for {count} prompts", param=name)
    return value


def _inputs(body: GenerateRequestBody, adapters: ServedAdapters, base_name: str) -> list[GenerateInput]:
    if body.text is not None and body.input_ids is not None:
        raise APIError(400, "text: give either text or input_ids, not both", param="text")
    if body.text is not None:
        prompts: list[dict[str, Any]] = [{"text": t} for t in _as_list(body.text, batch=isinstance(body.text, list))]
    elif body.input_ids is not None:
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = [{"input_ids": ids} for ids in _as_list(body.input_ids, batch)]
    else:
        raise APIError(400, "text: one of text or input_ids is required", param="text")
    if not prompts:
        name = "text" if body.text is not None else "input_ids"
        raise APIError(400, f"{name}: the batch is empty; give at least one prompt", param=name)
    count = len(prompts)
    params = [dict(p or {}) for p in _per_prompt(body.sampling_params, count, "sampling_params")]
    for p in params:
        unknown = sorted(set(p) - _SAMPLING_FIELDS)
        if unknown:
            raise APIError(400, f"sampling_params: unknown parameter(s) {unknown}", param="sampling_params")
        try:
            take_sampling_grammar(p)
        except ConstraintError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
    if isinstance(body.rid, str) and count > 1:
        rids = [f"{body.rid}-{i}" for i in range(count)]
    else:
        rids = _per_prompt(body.rid, count, "rid")
    priorities = _per_prompt(body.priority, count, "priority")
    loras = [adapters.resolve(None, name, base_name) for name in _per_prompt(body.lora_path, count, "lora_path")]
    bootstrap = bootstrap_of(body, count)
    return [
        GenerateInput(
            **prompt,
            sampling_params=params[i],
            return_logprob=body.return_logprob,
            top_logprobs_num=body.top_logprobs_num,
            logprob_start_len=body.logprob_start_len,
            stream=body.stream,
            rid=rids[i],
            priority=priorities[i],
            bootstrap=bootstrap,
            lora_name=loras[i],
        )
        for i, prompt in enumerate(prompts)
    ]


def _as_list(value: Any, batch: bool) -> list[Any]:
    return value if batch else [value]


def _output(out: dict[str, Any], return_logprob: bool, started: float) -> dict[str, Any]:
    meta = dict(out["meta_info"])
    reason = meta["finish_reason"]
    meta["finish_reason"] = None if reason is None else reason.to_dict()
    if not return_logprob:
        for key in _LOGPROB_KEYS:
            meta.pop(key, None)
    meta["e2e_latency"] = time.perf_counter() - started
    return {"text": out["text"], "output_ids": out["output_ids"], "meta_info": meta}


async def generate(
    tm: TokenizerManager, body: GenerateRequestBody, request: Request, adapters: ServedAdapters, base_name: str
) -> dict[str, Any] | list[dict[str, Any]] | StreamingResponse:
    """``adapters``: the LoRA adapters a prompt's ``lora_path`` may name; ``base_name``: the served model's name."""
    started = time.perf_counter()
    inputs = _inputs(body, adapters, base_name)
    is_batch = len(inputs) > 1
    results = start_generation(tm, inputs, RENAMES)
    if body.stream:
        results = await first_and_rest(results, request, RENAMES)
        firsts = [0]  # global index of each prompt's first choice
        for inp in inputs:
            sampling_params = cast(dict[str, Any], inp.sampling_params)  # _inputs gives every prompt a dict
            firsts.append(firsts[-1] + int(sampling_params.get("n", 1)))
        return EventStreamResponse(_chunks(results, firsts, body.return_logprob, started))
    with runtime_errors(RENAMES):
        outs = await cancel_on_disconnect(request, collect(results, RENAMES))
    outs.sort(key=lambda item: (item[0], item[1]["index"]))
    answers = [_output(out, body.return_logprob, started) for _, out in outs]
    return answers if is_batch or len(answers) > 1 else answers[0]


async def _chunks(
    results: AsyncGenerator[Tagged, None], firsts: list[int], return_logprob: bool, started: float
) -> AsyncGenerator[dict[str, Any], None]:
    """Turn the runtime's deltas into SGLang's cumulative chunks."""
    so_far: dict[int, dict[str, Any]] = {}
    async for p, out in results:
        index = firsts[p] + out["index"]
        acc = so_far.setdefault(index, {"text": "", "output_ids": [], **{k: [] for k in _LOGPROB_KEYS}})
        acc["text"] += out["text"]
        acc["output_ids"] += out["output_ids"]
        meta = dict(out["meta_info"])
        for k in _LOGPROB_KEYS:
            acc[k] += meta.get(k) or []
            meta[k] = acc[k]
        chunk = _output(
            {"text": acc["text"], "output_ids": acc["output_ids"], "meta_info": meta}, return_logprob, started
        )
        chunk["index"] = index
        yield chunk
