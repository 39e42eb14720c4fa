"""The waiting queue of a real server with one running slot, held by a long
request while the test fills the queue: its limit (past --max-queued-requests a
request is a 503, streamed or not) and its order (under --schedule-policy
priority the highest priority is admitted first, ties in arrival order).

Nothing here waits on the clock: each step waits for a state the server reports
(/get_server_info's running and queued counts), the blocking request ends when
the test aborts it, and the admission order is read from the scheduler's own
log, whose "Prefill batch" line of each admission counts its prompt tokens
(every prompt here has a length of its own)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from generation_utils import mixed_prompts
from helpers_pool import ServerPool, assert_whole_pool_back, stats
from helpers_server import ServerProcess, SharedServer, wait_until, wait_until_async
from helpers_shared_servers import QUEUE_LIMIT

BLOCKER_PROMPT = mixed_prompts(512, [3], seed=40)[0]
# Arrival order: (priority, prompt length). Admitted by priority, ties by arrival: 12, 14, 13, 11, 15 tokens.
QUEUED = [(0, 11), (5, 12), (1, 13), (5, 14), (-2, 15)]
PRIORITY_ORDER = [12, 14, 13, 11, 15]
PREFILL = re.compile(r"Prefill batch\. #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")


@pytest.fixture(scope="module")
def server(single_slot_servers: SharedServer) -> ServerProcess:
    """One running slot, --max-queued-requests QUEUE_LIMIT, --schedule-policy priority, at info level
    (shared with test_shutdown.py: helpers_shared_servers)."""
    return single_slot_servers.get()


def _generate(input_ids: list[int], max_new_tokens: int, **fields: Any) -> dict:
    return {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        **fields,
    }


def _counts(url: str) -> tuple[int, int]:
    """(running, queued) as the scheduler reports them."""
    s = stats(url)
    return s["num_running_reqs"], s["num_queue_reqs"]


async def _saturate(
    c: httpx.AsyncClient, queued: list[dict]
) -> tuple[asyncio.Task[httpx.Response], list[asyncio.Task[httpx.Response]]]:
    """The blocking request running (rid "blocker", 30000 tokens asked), then ``queued``
    sent one at a time, each waiting in the queue before the next is sent."""
    url = str(c.base_url).rstrip("/")
    blocker = asyncio.create_task(c.post("/generate", json=_generate(BLOCKER_PROMPT, 30000, rid="blocker")))
    assert await wait_until_async(lambda: _counts(url) == (1, 0), 60), _counts(url)
    tasks = []
    for i, body in enumerate(queued, start=1):
        tasks.append(asyncio.create_task(c.post("/generate", json=body)))
        assert await wait_until_async(lambda i=i: _counts(url) == (1, i), 60), _counts(url)
    return blocker, tasks


def _scenario(server: ServerProcess, body: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    """``body`` with a client of ``server``; then the whole pool must be back."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            await body(c)

    asyncio.run(run())
    assert_whole_pool_back(ServerPool(server.url))


def test_a_full_queue_refuses_with_503_and_the_server_keeps_serving(server):
    async def body(c: httpx.AsyncClient) -> None:
        waiting = [_generate(prompt, 4) for prompt in mixed_prompts(512, [6] * QUEUE_LIMIT, seed=41)]
        blocker, queued = await _saturate(c, waiting)
        for stream in (False, True):
            refused = await c.post("/generate", json=_generate([7, 8, 9], 4, stream=stream))
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "queue_full"
        assert _counts(server.url) == (1, QUEUE_LIMIT)  # the refusals changed nothing
        # Every client goes away: their requests are aborted, running or queued.
        for task in [blocker, *queued]:
            task.cancel()
        assert await wait_until_async(lambda: _counts(server.url) == (0, 0), 60), _counts(server.url)
        served = await c.post(
            "/generate", json={"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 4, "n": 2}}
        )
        assert served.status_code == 200 and len(served.json()) == 2

    _scenario(server, body)


def test_priority_decides_the_admission_order(server):
    prompts = mixed_prompts(512, [length for _, length in QUEUED], seed=42)
    mark = 0

    async def body(c: httpx.AsyncClient) -> None:
        nonlocal mark
        waiting = [_generate(p, 2, priority=priority) for p, (priority, _) in zip(prompts, QUEUED, strict=False)]
        blocker, queued = await _saturate(c, waiting)
        mark = len(server.lines)
        assert (await c.post("/abort_request", json={"rid": "blocker"})).json() == {"success": True}
        assert (await blocker).json()["meta_info"]["finish_reason"]["type"] == "abort"
        answers = [(await task).json() for task in queued]
        assert [a["meta_info"]["completion_tokens"] for a in answers] == [2] * len(QUEUED)

    _scenario(server, body)

    def admitted() -> list[tuple[int, int]]:
        """(requests, prompt tokens) of each prefill line after the mark that is a queued prompt's
        (the blocker's own line may reach the log after the mark)."""
        lines = [(int(n), int(new) + int(cached)) for n, new, cached in PREFILL.findall("".join(server.lines[mark:]))]
        return [(n, length) for n, length in lines if length in PRIORITY_ORDER]

    # The answers can overtake the log lines on their way through the pipe.
    assert wait_until(lambda: len(admitted()) >= len(QUEUED), timeout=10), admitted()
    assert admitted() == [(1, length) for length in PRIORITY_ORDER]
