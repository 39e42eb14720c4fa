"""Abort for every request shape, through a real server: n>1 streamed and not,
a client gone mid-request, a refusal (503) of part of an n>1 request or of a
batch, a request still in the queue. Each time generation must stop well short
of what the request asked for, and the whole KV pool must come back (a flush
empties the cache and every page is free: helpers_pool). Also the access log.

Then the TokenizerManager alone over real ZMQ sockets, the test playing the
scheduler and the detokenizer: every choice is aborted exactly once, and a bad
reply fails only its own request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from helpers_pool import ServerPool, assert_whole_pool_back, idle, stats
from helpers_runtime import LENGTH, ScriptedRuntime, collect, generate
from helpers_server import PRIORITY_BACKENDS, metric, serving, wait_until, wait_until_async

from radixserve.messages import AbortRequest, FinishReason, TextBatch
from radixserve.server.tokenizer_manager import RequestFailedError

# Long enough that no request can finish in the second or so before its client leaves, and that a
# quarter of it (the bound on what an aborted request may generate) outlasts that second with room to
# spare on a fast machine (the tiny model decodes 4 choices at about 1 ms a step here).
N, MAX_TOKENS = 4, 16000
LONG = {"prompt": "keep going", "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(long_llama_dir):
    """N running slots and one queue place: an n=N request runs whole, one more waits, the next is refused.
    At info level with ``--log-requests``, for the access log test."""
    with serving(
        long_llama_dir,
        "--max-total-tokens",
        "131072",
        "--max-running-requests",
        str(N),
        "--max-queued-requests",
        "1",
        "--log-level",
        "info",
        "--log-requests",
        *PRIORITY_BACKENDS,
    ) as srv:
        yield srv


def assert_stopped(url: str, generated_before: int, limit: int) -> None:
    """Nothing is left running (so generation has stopped), it stopped short of
    ``limit`` tokens since ``generated_before``, and the whole pool is back."""
    assert wait_until(lambda: idle(stats(url)), timeout=20), stats(url)
    generated = stats(url)["generation_tokens_total"]
    assert generated - generated_before < limit, f"{generated - generated_before} tokens: the request was not aborted"
    assert_whole_pool_back(ServerPool(url))


def test_n4_streaming_client_gone(server):
    before = stats(server.url)["generation_tokens_total"]
    body = {"model": "tiny", **LONG, "n": N, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [next(lines) for _ in range(3 * N)]
        assert sum(line.startswith("data: {") for line in got) >= N
        assert wait_until(lambda: stats(server.url)["num_running_reqs"] == N, timeout=10)  # every choice runs
    assert_stopped(server.url, before, N * MAX_TOKENS // 4)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": "tiny", **LONG, "n": N}),
        (
            "/generate",
            {"text": "keep going", "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True, "n": N}},
        ),
    ],
)
def test_n4_non_streaming_client_gone(server, path, body):
    """The client leaves once every choice runs."""
    url = server.url

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            waiting = asyncio.create_task(c.post(path, json=body))
            assert await wait_until_async(lambda: stats(url)["num_running_reqs"] == N, 20), stats(url)
            assert not waiting.done()  # no answer yet: it cannot finish while the test works
            waiting.cancel()  # the client leaves
            with pytest.raises(asyncio.CancelledError):
                await waiting

    before = stats(url)["generation_tokens_total"]
    asyncio.run(scenario())
    assert_stopped(url, before, N * MAX_TOKENS // 4)


def test_the_server_serves_after_the_aborts(server):
    response = httpx.post(
        server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5, "n": 2}, timeout=60
    )
    assert response.status_code == 200 and len(response.json()["choices"]) == 2
    assert_whole_pool_back(ServerPool(server.url))


def test_a_refused_part_aborts_the_rest(server):
    """n=N+2 with N running slots and one queue place: the warm-up prefill
    runs, then N choices are admitted, one queued and the last refused. The
    request is a 503 and the admitted and queued choices are aborted; likewise
    for a batch of N+2 prompts, and streamed."""
    url = server.url
    prompts = [f"prompt {i}" for i in range(N + 2)]
    cases = [
        ("/v1/completions", {"model": "tiny", **LONG, "n": N + 2}),
        ("/v1/completions", {"model": "tiny", **LONG, "n": N + 2, "stream": True}),
        ("/v1/completions", {"model": "tiny", **LONG, "prompt": prompts}),
        ("/generate", {"text": prompts, "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}}),
    ]
    for path, body in cases:
        errors_before = metric(url, "radixserve:num_request_errors_total", code="503")
        before = stats(url)["generation_tokens_total"]
        response = httpx.post(url + path, json=body, timeout=60)
        if response.status_code == 200 and body.get("stream"):
            # The admitted choice's first token beat the refusal: an in-band error ends the stream.
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "queue_full", events
        else:
            assert response.status_code == 503, (path, body, response.text)
            assert response.json()["error"]["code"] == "queue_full"
            assert metric(url, "radixserve:num_request_errors_total", code="503") == errors_before + 1
        assert_stopped(url, before, (N + 1) * MAX_TOKENS // 4)


def test_a_queued_request_whose_client_leaves(server):
    url = server.url

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            running = asyncio.create_task(c.post("/v1/completions", json={"model": "tiny", **LONG, "n": N}))
            assert await wait_until_async(lambda: stats(url)["num_running_reqs"] == N, 20)
            # A streamed request's headers wait for its first token, so it waits in the queue unanswered.
            queued = asyncio.create_task(c.post("/v1/completions", json={"model": "tiny", **LONG, "stream": True}))
            assert await wait_until_async(lambda: stats(url)["num_queue_reqs"] == 1, 20)
            assert stats(url)["num_running_reqs"] == N
            queued.cancel()  # the client leaves
            assert await wait_until_async(lambda: stats(url)["num_queue_reqs"] == 0, 20)
            assert stats(url)["num_running_reqs"] == N  # the running ones go on
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running

    before = stats(url)["generation_tokens_total"]
    asyncio.run(scenario())
    assert_stopped(url, before, N * MAX_TOKENS // 4)  # the running ones did not finish either


def _access_lines(server, marker: str) -> list[str]:
    return [line for line in server.lines if "radixserve.access" in line and marker in line]


def test_access_log_lines(server):
    body = {"model": "tiny", "prompt": "access log probe", "max_tokens": 5, "n": 2, "ignore_eos": True}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert wait_until(lambda: _access_lines(server, answer["id"]), timeout=10)
    (line,) = _access_lines(server, answer["id"])
    usage = answer["usage"]
    assert f"POST /v1/completions 200 prompt={usage['prompt_tokens']} completion=10 " in line
    assert "latency=" in line and "client=127.0.0.1:" in line
    assert "finish=length,length" in line and "access log probe" in line  # --log-requests
    # An error is logged and counted too, with its status.
    refused = httpx.post(server.url + "/v1/completions", json={**body, "model": "nope"}, timeout=60)
    assert refused.status_code == 404
    assert wait_until(lambda: _access_lines(server, "POST /v1/completions 404"), timeout=10)
    assert metric(server.url, "radixserve:num_request_errors_total", code="404") >= 1
    # A body over 2 KB is cut.
    httpx.post(server.url + "/v1/completions", json={**body, "prompt": "x" * 5000, "max_tokens": 1}, timeout=60)
    assert wait_until(lambda: _access_lines(server, "x" * 100), timeout=10)
    assert all(len(line) < 3000 for line in _access_lines(server, "x" * 100))


# ---- the TokenizerManager over real sockets, the test playing the scheduler and detokenizer -------------


def test_bad_replies_fail_only_their_request():
    async def scenario() -> None:
        rt = ScriptedRuntime()
        try:
            a = asyncio.create_task(collect(generate(rt.tm, "a")))
            b = asyncio.create_task(collect(generate(rt.tm, "b")))
            ids = {r.rid.split("#")[0]: r.rid for r in await rt.received(2)}
            await rt.detokenizer.send(b"not a pickle")
            await rt.detokenizer.send_pyobj("not a reply")
            await rt.detokenizer.send_pyobj(TextBatch([object()]))
            await rt.reply((ids["a"], [5], None), error="detokenization failed: boom")
            await rt.reply((ids["b"], [5], None))
            with pytest.raises(RequestFailedError, match="boom"):
                await a
            assert await rt.received(1) == [AbortRequest(ids["a"])]
            assert rt.tm.num_in_flight == 2  # a until the scheduler's final output comes
            await rt.reply((ids["a"], [6], FinishReason("abort")), (ids["b"], [6], LENGTH))
            assert [out["text"] for out in await b] == ["tt"]
            assert rt.tm.num_in_flight == 0 and await rt.nothing_more()
            # The scheduler failing a request (500) is an error for that request, with nothing left to abort.
            c = asyncio.create_task(collect(generate(rt.tm, "c")))
            (req,) = await rt.received(1)
            await rt.reply(
                (req.rid, [], FinishReason("abort", status_code=500, message="internal error: RuntimeError: x"))
            )
            with pytest.raises(RequestFailedError, match="internal error"):
                await c
            assert rt.tm.num_in_flight == 0 and await rt.nothing_more()
        finally:
            await rt.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_n2_cancelled_aborts_each_choice_once(stream):
    async def scenario() -> None:
        rt = ScriptedRuntime()
        try:
            consumer = asyncio.create_task(collect(generate(rt.tm, "r", n=2, stream=stream)))
            (warm,) = await rt.received(1)
            assert warm.sampling_params.max_new_tokens == 0
            await rt.reply((warm.rid, [], LENGTH))
            children = [r.rid for r in await rt.received(2)]
            await rt.reply(*((rid, [7], None) for rid in children))
            await asyncio.sleep(0.1)
            consumer.cancel()  # the client is gone
            with pytest.raises(asyncio.CancelledError):
                await consumer
            aborts = await rt.received(2)
            assert sorted(a.rid for a in aborts) == sorted(children)
            assert await rt.nothing_more()  # exactly once each, and none for the finished warm-up
            assert rt.tm.num_in_flight == 2  # until the scheduler confirms
            await rt.reply(*((rid, [8], FinishReason("abort")) for rid in children))
            await asyncio.sleep(0.1)
            assert rt.tm.num_in_flight == 0 and await rt.nothing_more()
        finally:
            await rt.close()

    asyncio.run(scenario())
