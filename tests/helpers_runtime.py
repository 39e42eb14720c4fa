"""A TokenizerManager over real ZMQ sockets, with the test playing the scheduler
and the detokenizer: it reads what the manager sends and answers when it
chooses, so the order of events is the test's, not the clock's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import zmq.asyncio

from radixserve.config import ServerArgs
from radixserve.ipc import Endpoints, pull_socket, push_socket
from radixserve.messages import FinishReason, TextBatch, TextOutput, TokenOutput
from radixserve.server.tokenizer_manager import GenerateInput, TokenizerManager

SUMMARY = {"context_length": 1024, "vocab_size": 100, "max_total_tokens": 4096, "page_size": 1}
LENGTH = FinishReason("length")


class ScriptedRuntime:
    """The sockets the scheduler and the detokenizer would hold, and the manager between them."""

    def __init__(self) -> None:
        self.endpoints = Endpoints.fresh()
        self.ctx = zmq.asyncio.Context()
        self.scheduler = pull_socket(self.ctx, self.endpoints.scheduler)
        self.tm = TokenizerManager(ServerArgs(), None, self.endpoints, SUMMARY)
        self.detokenizer = push_socket(self.ctx, self.endpoints.tokenizer_manager)
        self.tm.start()

    async def reply(self, *outputs: tuple[str, list[int], FinishReason | None], error: str | None = None) -> None:
        """One detokenizer batch: ``(rid, new token ids, finish reason)`` each, the text one "t" a token."""
        await self.detokenizer.send_pyobj(
            TextBatch(
                [
                    TextOutput(TokenOutput(rid, ids, finish, queue_time=0.0), "t" * len(ids), error=error)
                    for rid, ids, finish in outputs
                ]
            )
        )

    async def received(self, count: int) -> list:
        """The next ``count`` messages the manager sent the scheduler."""
        return [await asyncio.wait_for(self.scheduler.recv_pyobj(), 10) for _ in range(count)]

    async def nothing_more(self) -> bool:
        return await self.scheduler.poll(300) == 0

    async def close(self) -> None:
        await self.tm.close()
        self.scheduler.close()
        self.detokenizer.close()
        self.ctx.term()
        self.endpoints.remove()


def generate(tm: TokenizerManager, rid: str, n: int = 1, stream: bool = False) -> AsyncIterator[dict]:
    """A three-token prompt asking for up to 50 tokens."""
    params = {"max_new_tokens": 50, "n": n}
    return tm.generate(GenerateInput(input_ids=[1, 2, 3], sampling_params=params, rid=rid, stream=stream))


async def collect(results: AsyncIterator[dict]) -> list[dict]:
    return [out async for out in results]
