"""``radixserve bench offline``: the Engine in this process (its scheduler and
detokenizer spawned as usual), every request streamed through its
TokenizerManager so each token is timed as it leaves the detokenizer. With the
default arrivals all requests are submitted at once and the engine's own
batching decides the rest, as a batch ``Engine.generate`` call would."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve.bench.datasets import BenchRequest
from radixserve.bench.driver import Arrivals, Send, run_requests
from radixserve.bench.memory import PeakRSS, engine_pids
from radixserve.bench.metrics import RequestResult
from radixserve.server.tokenizer_manager import GenerateInput

if TYPE_CHECKING:
    from radixserve.engine import Engine


def sampling_params(request: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    return {"max_new_tokens": request.output_len, "temperature": 0.0, "ignore_eos": ignore_eos}


def make_send(engine: Engine, ignore_eos: bool) -> Send:
    tm = engine.tokenizer_manager

    async def send(request: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_len=request.prompt_len)
        inp = GenerateInput(
            text=request.prompt,
            input_ids=request.input_ids,
            stream=True,
            sampling_params=sampling_params(request, ignore_eos),
        )
        result.sent = time.perf_counter()
        try:
            async for out in tm.generate(inp):
                meta = out["meta_info"]
                result.add_tokens(meta["completion_tokens"] - result.output_len, time.perf_counter())
                result.prompt_len = meta["prompt_tokens"]
                result.cached_tokens = meta["cached_tokens"]
        except Exception as exc:  # one failed request must not end the run; it is counted and shown
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    return send


def run_offline(
    engine: Engine,
    requests: list[BenchRequest],
    warmup: list[BenchRequest],
    arrivals: Arrivals,
    ignore_eos: bool,
    progress: Callable[[], None] | None = None,
) -> tuple[list[RequestResult], float, int | None]:
    """Results, duration and peak RSS (this process and its children) of one run."""
    send = make_send(engine, ignore_eos)
    if warmup:
        failed = [r.error for r in engine.run_coroutine(run_requests(warmup, send, Arrivals()))[0] if not r.ok]
        if failed:
            raise RuntimeError(f"warm-up request failed: {failed[0]}")
    with PeakRSS(engine_pids()) as peak:
        results, duration = engine.run_coroutine(run_requests(requests, send, arrivals, progress))
    return results, duration, peak.bytes
