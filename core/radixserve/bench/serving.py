"""``radixserve bench serving``: an async HTTP client for any OpenAI-compatible
server (radixserve, vLLM, SGLang), streaming ``/v1/completions``.

Prompts go as token ids (``prompt: [int, ...]``) or text; ``ignore_eos`` and
``stream_options.continuous_usage_stats`` are sent as the extras those servers
share. Tokens per chunk come from the running usage when the server reports it,
else each chunk with text counts as one token; the final usage gives the output
count and, where reported, the cached prompt tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import httpx

from radixserve.bench.datasets import BenchRequest
from radixserve.bench.driver import Arrivals, Send, run_requests
from radixserve.bench.memory import PeakRSS, parent_pid
from radixserve.bench.metrics import RequestResult


def completion_body(model: str, request: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": request.input_ids if request.input_ids is not None else request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": ignore_eos,
    }


def _apply_chunk(result: RequestResult, chunk: dict[str, Any], now: float) -> None:
    usage = chunk.get("usage")
    choices = chunk.get("choices") or []
    if usage and usage.get("completion_tokens") is not None:
        result.add_tokens(usage["completion_tokens"] - result.output_len, now)
        result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.cached_tokens = details["cached_tokens"]
    elif choices and choices[0].get("text"):
        result.add_tokens(1, now)


def make_send(client: httpx.AsyncClient, model: str, ignore_eos: bool) -> Send:
    async def send(request: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_len=request.prompt_len)
        result.sent = time.perf_counter()
        try:
            async with client.stream(
                "POST", "/v1/completions", json=completion_body(model, request, ignore_eos)
            ) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    raise RuntimeError(f"HTTP {response.status_code}: {body[:300]}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RuntimeError(f"stream error: {chunk['error']}")
                    _apply_chunk(result, chunk, time.perf_counter())
        except Exception as exc:  # one failed request must not end the run; it is counted and shown
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    return send


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def server_info(base_url: str, api_key: str | None) -> dict[str, Any] | None:
    """radixserve's ``/get_server_info``; None from servers without it."""
    async with httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=30) as client:
        try:
            response = await client.get("/get_server_info")
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None


async def first_model(base_url: str, api_key: str | None) -> str:
    async with httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=30) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        model: str = response.json()["data"][0]["id"]
        return model


def server_pids(base_url: str, info: dict[str, Any] | None) -> list[int]:
    """The server's processes (the HTTP process is its children's parent), when it
    runs on this host and says what they are; else none, and memory is n/a."""
    host = urlparse(base_url).hostname or ""
    if not info or "pids" not in info or host not in ("127.0.0.1", "localhost", "::1"):
        return []
    children: list[int] = list(info["pids"].values())
    parents = {ppid for ppid in map(parent_pid, children) if ppid is not None and ppid != 1}
    return sorted(parents) + children


async def run_serving(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    warmup: list[BenchRequest],
    arrivals: Arrivals,
    ignore_eos: bool,
    api_key: str | None = None,
    pids: list[int] | None = None,
    progress: Callable[[], None] | None = None,
) -> tuple[list[RequestResult], float, int | None]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=None, limits=limits) as client:
        send = make_send(client, model, ignore_eos)
        if warmup:
            failed = [r.error for r in (await run_requests(warmup, send, Arrivals()))[0] if not r.ok]
            if failed:
                raise RuntimeError(f"warm-up request failed: {failed[0]}")
        with PeakRSS(pids or []) as peak:
            results, duration = await run_requests(requests, send, arrivals, progress)
    return results, duration, peak.bytes
