"""The server as an operator meets it while it runs and when it stops: the version,
an oversized header answered in the OpenAI envelope, and SIGTERM under load
(stop admitting, drain, end the rest in order, exit 0).

No step waits on the clock. The SIGTERM test holds the only running slot with a
request that cannot finish while the test works, and queues the others behind
it, so what is in flight when the signal lands is known; the drain then goes on
until the test acts (the long request's client leaves, so the short ones run and
complete; a second signal ends the rest). The deadline itself is checked on the
TokenizerManager over real sockets, with the test playing the scheduler."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
from urllib.parse import urlparse

import httpx
import pytest
from helpers_pool import stats
from helpers_runtime import ScriptedRuntime, collect, generate
from helpers_server import process_alive, wait_until
from helpers_shared_servers import HEADER_LIMIT

from radixserve import __version__
from radixserve.config import ServerArgs
from radixserve.server.state import SHUTDOWN_REASON, ServerState
from radixserve.server.tokenizer_manager import RuntimeDeadError

ENDLESS = 30000  # tokens: no request asking for this many can finish while the test works


@pytest.fixture(scope="module")
def server(single_slot_servers):
    """One running slot, so the other requests queue behind the first; --max-header-size HEADER_LIMIT and
    --shutdown-timeout DRAIN_DEADLINE_S, at info level (shared with test_queue.py: helpers_shared_servers;
    the SIGTERM test stops it, and a later user gets a new one)."""
    return single_slot_servers.get()


def test_the_version_is_in_server_info(server):
    assert httpx.get(server.url + "/server_info", timeout=30).json()["version"] == __version__


def _raw_request(url: str, header_bytes: int) -> bytes:
    """A GET with one header of ``header_bytes``, sent whole; everything the server answers."""
    parsed = urlparse(url)
    request = (
        f"GET /health HTTP/1.1\r\nHost: {parsed.netloc}\r\nConnection: close\r\nX-Big: {'a' * header_bytes}\r\n\r\n"
    ).encode()
    with socket.create_connection((parsed.hostname, parsed.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("size", [2 * HEADER_LIMIT, 1024 * 1024])
def test_oversized_header_gets_431_in_the_envelope(server, size):
    answer = _raw_request(server.url, size)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), answer[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "header_too_large" and str(HEADER_LIMIT) in error["message"]
    # Under the limit is fine, and the server keeps serving.
    assert _raw_request(server.url, HEADER_LIMIT // 2).startswith(b"HTTP/1.1 200 ")


def test_malformed_request_line_gets_400_in_the_envelope(server):
    parsed = urlparse(server.url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=30) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and json.loads(body)["error"]["code"] == "invalid_http"


def _chat(url: str, stream: bool, max_tokens: int, leave: threading.Event | None = None) -> dict:
    """One request's outcome: status, and for a stream its data lines. With
    ``leave``, a stream's client reads one event, then leaves when it is set."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    outcome: dict = {"stream": stream, "max_tokens": max_tokens}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
            outcome["status"] = response.status_code
            if leave is not None:
                lines = response.iter_lines()  # kept: a dropped iterator closes the connection
                next(lines)
                leave.wait(120)
                return {**outcome, "left": True}
            if stream and response.status_code == 200:
                outcome["events"] = [
                    line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
                ]
            else:
                outcome["body"] = json.loads(response.read())
    except httpx.HTTPError as exc:  # a cut connection: what must never happen
        outcome["transport_error"] = repr(exc)
    return outcome


def _assert_orderly(outcome: dict) -> str:
    """Either a complete answer or an orderly error end; returns which."""
    assert "transport_error" not in outcome, outcome
    if not outcome["stream"] or outcome["status"] != 200:
        if outcome["status"] == 200:
            assert outcome["body"]["usage"]["completion_tokens"] == outcome["max_tokens"], outcome
            return "complete"
        assert outcome["status"] == 503, outcome
        assert "shutting down" in outcome["body"]["error"]["message"], outcome
        return "ended"
    events = outcome["events"]
    assert events and events[-1] == "[DONE]", outcome
    last = json.loads(events[-2])
    if "error" in last:
        assert "shutting down" in last["error"]["message"], last
        return "ended"
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert finishes == ["length"], outcome
    return "complete"


class _Client(threading.Thread):
    def __init__(self, url: str, stream: bool, max_tokens: int, leave: threading.Event | None = None):
        super().__init__(daemon=True)
        self.args = (url, stream, max_tokens, leave)
        self.outcome: dict = {}

    def run(self) -> None:
        self.outcome = _chat(*self.args)


def test_sigterm_under_load_ends_every_request_in_order_and_exits_0(server):
    """The last test of the module's server: it stops it."""
    url = server.url
    pids = httpx.get(url + "/get_server_info", timeout=30).json()["pids"]
    leave = threading.Event()
    holder = _Client(url, True, ENDLESS, leave)  # runs until its client leaves
    holder.start()
    assert wait_until(lambda: stats(url)["num_running_reqs"] == 1, timeout=60), stats(url)
    # Queued behind it in this order: two short requests, then two that cannot finish.
    short = [_Client(url, stream, 4) for stream in (False, True)]
    long = [_Client(url, stream, ENDLESS) for stream in (True, False)]
    for i, client in enumerate(short + long, start=1):
        client.start()
        assert wait_until(lambda i=i: stats(url)["num_queue_reqs"] == i, timeout=60), stats(url)
    assert stats(url)["num_in_flight"] == 5

    server.proc.send_signal(signal.SIGTERM)
    # Draining (nothing can finish yet): no new work, /health says so, both in the envelope.
    assert wait_until(lambda: httpx.get(url + "/health", timeout=30).status_code == 503, timeout=60)
    refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    # The first client leaves: its request is aborted, and the drain lets the short ones run to the end.
    leave.set()
    holder.join(60)
    assert holder.outcome == {"stream": True, "max_tokens": ENDLESS, "status": 200, "left": True}, holder.outcome
    for client in short:
        client.join(120)
        assert _assert_orderly(client.outcome) == "complete", client.outcome
    assert all(client.is_alive() for client in long), "a request that cannot finish ended before the second signal"
    server.proc.send_signal(signal.SIGTERM)  # the second signal: end the rest now
    for client in long:
        client.join(60)
        assert _assert_orderly(client.outcome) == "ended", client.outcome
    assert server.wait_exit(timeout=60) == 0, server.log
    assert "SIGTERM: draining" in server.log
    assert "a second signal: ending 2 request(s) still running" in server.log, server.log
    assert "Traceback" not in server.log, server.log
    assert wait_until(lambda: not any(process_alive(pid) for pid in pids.values()), timeout=10), "orphaned children"


def test_the_drain_deadline_ends_what_is_still_in_flight(caplog):
    """At --shutdown-timeout the requests still in flight get the shutdown error;
    a request the scheduler never answers stands for one that cannot finish."""

    async def scenario() -> None:
        rt = ScriptedRuntime()
        try:
            state = ServerState(ServerArgs(), request_exit=lambda code: None)
            state.tm, state.status = rt.tm, "ready"
            pending = asyncio.create_task(collect(generate(rt.tm, "never-answered")))
            await rt.received(1)  # it reached the scheduler
            with caplog.at_level(logging.INFO, logger="radixserve.server.state"):
                await state.drain(timeout=0.2)
            with pytest.raises(RuntimeDeadError, match=SHUTDOWN_REASON):
                await pending
            assert state.status == "draining" and rt.tm.num_in_flight == 0
        finally:
            await rt.close()

    asyncio.run(scenario())
    assert "shutdown timeout (0 s) reached: ending 1 request(s) still running" in caplog.text
