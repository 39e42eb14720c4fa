"""Stress: 500 streaming requests, 32 at a time, 10% of the clients leaving
after a few chunks, against a real server on the tiny Llama. Afterwards the
metrics add up with the scheduler's own counters, and the whole KV pool is back."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from helpers_pool import ServerPool, assert_whole_pool_back, idle, stats
from helpers_server import wait_until
from prometheus_client.parser import text_string_to_metric_families

REQUESTS, CONCURRENCY, MAX_TOKENS = 500, 32, 12
DISCONNECT_EVERY = 10  # request i leaves early when i % 10 == 0: 10%


def metrics(url: str) -> dict[tuple[str, str], float]:
    """(sample name, its non-model label values joined) -> value."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        (s.name, ",".join(v for k, v in sorted(s.labels.items()) if k != "model_name")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


async def one(client: httpx.AsyncClient, i: int) -> tuple[str, int]:
    """``("left", chunks read)`` for a client that leaves early, else ``(finish_reason, chunks)``."""
    body = {
        "model": "tiny",
        "prompt": f"stress request {i} " * (1 + i % 5),
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    chunks, finish = 0, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return finish, chunks
            event = json.loads(line[6:])
            assert "error" not in event, event
            chunks += 1
            finish = event["choices"][0]["finish_reason"] or finish
            if i % DISCONNECT_EVERY == 0 and chunks == 2:
                return "left", chunks  # leaving the block closes the connection mid-stream
    raise AssertionError(f"request {i}: the stream ended without [DONE]")


async def run_all(url: str) -> list[tuple[str, int]]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def gated(i: int) -> tuple[str, int]:
            async with gate:
                return await one(client, i)

        return await asyncio.gather(*(gated(i) for i in range(REQUESTS)))


@pytest.mark.slow
def test_500_streams_with_disconnects(tiny_server):
    url = tiny_server.url
    m0, s0 = metrics(url), stats(url)
    started = time.perf_counter()
    results = asyncio.run(run_all(url))
    elapsed = time.perf_counter() - started

    left = sum(r == "left" for r, _ in results)
    assert left == REQUESTS // DISCONNECT_EVERY
    assert all(r == "length" for r, _ in results if r != "left")

    assert wait_until(lambda: idle(stats(url)), timeout=20), stats(url)
    m1, s1 = metrics(url), stats(url)

    def delta(name: str, labels: str = "") -> float:
        return m1.get((name, labels), 0) - m0.get((name, labels), 0)

    finished = {r: delta("radixserve:num_requests_total", r) for r in ("stop", "length", "abort")}
    assert sum(finished.values()) == REQUESTS, finished
    assert finished["abort"] <= left and finished["length"] >= REQUESTS - left, finished
    # The server's token counters count exactly what the scheduler did, aborted requests included.
    for counter in ("generation", "prompt", "cached"):
        assert (
            delta(f"radixserve:{counter}_tokens_total") == s1[f"{counter}_tokens_total"] - s0[f"{counter}_tokens_total"]
        ), counter
    assert delta("radixserve:generation_tokens_total") >= (REQUESTS - left) * MAX_TOKENS
    assert delta("radixserve:queue_time_seconds_count") == REQUESTS
    # A client that left before its response was complete is a 499 in the access log.
    assert 0 < delta("radixserve:num_request_errors_total", "499") <= left
    assert_whole_pool_back(ServerPool(url))
    print(
        f"\nstress: {REQUESTS} streams at concurrency {CONCURRENCY}, {left} clients left early, "
        f"{elapsed:.1f} s, {finished}, {delta('radixserve:generation_tokens_total'):.0f} tokens generated"
    )
