"""No Nagle stall on kept-alive connections (issue 21, item 6).

A response goes out as two writes (headers, then body). Without TCP_NODELAY on
the accepted socket, Nagle holds the body until the client ACKs the headers, and
a client on a kept-alive connection delays that ACK by at least 40 ms (Linux's
minimum delayed-ACK timeout): every request then takes 40+ ms. Here, on the
tiny Llama, GET /health answers in about 1 ms and a one-token chat completion
in 7-9 ms on an idle 2-core box; the bounds leave room for a loaded CI machine
and still sit far below the 44-60 ms of a stalled request. Medians, after a
warm-up request, so that one slow outlier cannot fail the test.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai

from radixserve.bench.metrics import median_call_ms
from radixserve.server.listen import bind_socket

HEALTH_BOUND_MS = 15
CHAT_BOUND_MS = 30


def test_accepted_connections_have_nodelay():
    """The mechanism, without timing: asyncio disables Nagle on the connections
    accepted from the socket ``run_server`` binds."""

    async def accepted_nodelay() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        async with await asyncio.start_server(handle, sock=bind_socket("127.0.0.1", 0)) as server:
            _, writer = await asyncio.open_connection(*server.sockets[0].getsockname())
            writer.close()
            return await asyncio.wait_for(accepted, 10)

    assert asyncio.run(accepted_nodelay()) != 0


def test_keepalive_health_has_no_stall(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=30) as http:
        median = median_call_ms(lambda: http.get("/health").raise_for_status(), 30)
    assert median < HEALTH_BOUND_MS, f"GET /health over a kept-alive connection: median {median:.1f} ms"


def test_keepalive_one_token_chat_has_no_stall(tiny_server):
    def one_token_chat() -> None:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)

    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        median = median_call_ms(one_token_chat, 20)
    assert median < CHAT_BOUND_MS, f"one-token chat completion through openai: median {median:.1f} ms"
