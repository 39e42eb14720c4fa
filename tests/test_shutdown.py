"""The server as an operator meets it while it runs and when it stops: /version,
an oversized header answered in the OpenAI envelope, and SIGTERM under load
(stop admitting, drain up to --shutdown-timeout, end the rest in order, exit 0)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest
from helpers_server import ServerProcess, process_alive, wait_until

from radixserve import __version__

# Long enough for a 4-token request to finish on a loaded 2-core box (6 s was
# not, once), far too short for a 12000-token one.
SHUTDOWN_TIMEOUT_S = 15.0
HEADER_LIMIT = 8192


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    # A long context, so that the requests below are still generating when the drain ends.
    model = tiny_model_factory(arch="llama", max_position_embeddings=16384)
    with ServerProcess(
        "--model",
        str(model),
        "--served-model-name",
        "m",
        "--max-total-tokens",
        "65536",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        "--max-header-size",
        str(HEADER_LIMIT),
    ) as srv:
        srv.wait_ready()
        yield srv


def test_version_route(server):
    assert httpx.get(server.url + "/version", timeout=30).json() == {"version": __version__}


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


def _chat(url: str, stream: bool, max_tokens: int) -> dict:
    """One request's outcome: status, and for a stream its data lines."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    outcome: dict = {"stream": stream, "max_tokens": max_tokens}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
            outcome["status"] = response.status_code
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


def test_sigterm_under_load_ends_every_request_in_order_and_exits_0(server):
    """Runs last in the module: it stops the server."""
    url = server.url
    pids = httpx.get(url + "/get_server_info", timeout=30).json()["pids"]
    outcomes: list[dict] = []
    # Short requests finish inside the drain window, long ones are ended at its deadline.
    shapes = [(stream, tokens) for stream in (True, False) for tokens in (4, 4, 12000, 12000)]
    threads = [threading.Thread(target=lambda s=s, t=t: outcomes.append(_chat(url, s, t))) for s, t in shapes]
    for t in threads:
        t.start()
    assert wait_until(
        lambda: httpx.get(url + "/get_server_info", timeout=30).json()["num_in_flight"] >= 4, timeout=60
    ), "the requests never started"
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    # While draining: no new work, /health says so, both in the envelope.
    assert wait_until(lambda: httpx.get(url + "/health", timeout=30).status_code == 503, timeout=SHUTDOWN_TIMEOUT_S)
    refused = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    for t in threads:
        t.join(60)
    code = server.wait_exit(timeout=30)
    elapsed = time.monotonic() - started
    assert code == 0, server.log
    assert elapsed < SHUTDOWN_TIMEOUT_S + 15, elapsed
    kinds = [_assert_orderly(o) for o in outcomes]
    assert len(outcomes) == len(shapes)
    assert "ended" in kinds, outcomes  # the long ones really were cut at the deadline
    assert kinds.count("complete") >= 4, outcomes  # the short ones finished
    assert "Traceback" not in server.log, server.log
    assert wait_until(lambda: not any(process_alive(pid) for pid in pids.values()), timeout=10), "orphaned children"
