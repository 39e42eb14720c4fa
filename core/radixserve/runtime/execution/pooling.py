"""Embedding requests in the model worker.

An embedding request is a prefill-only request (``max_new_tokens`` 0) whose
step rows carry the model's final hidden states (layers/pooler.py) instead of
logits to sample from. ``LogitsRows.extend`` (batch.py) picks its rows: the
last prompt token's in the chunk that ends the prompt (``last``), or every
token of every chunk (``mean``; the prefill planner then matches no cached
prefix for it, since a cached token has KV but no hidden state). The model
worker hands them to ``EmbeddingPooling`` in step order, which keeps a prompt's
running sum on its request between chunks and sends each finished embedding to
the host with the step's other results; the scheduler gives it to its request,
which then finishes like any prefill-only request, freeing its KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.checkpoints.embedding import EmbeddingConfig
from radixserve.layers.pooler import Pooler
from radixserve.runtime.execution.request import Req
from radixserve.transfer import HostCopy, HostTransfer


@dataclass
class EmbedRows:
    """``count`` logits rows (``LogitsRows.embed`` lists them in row order) hold the
    final hidden states of ``req``'s last ``count`` tokens of the step. ``carry``:
    add what its earlier chunks pooled; ``done``: they end its prompt."""

    req: Req
    count: int
    carry: bool
    done: bool

    @classmethod
    def of(cls, req: Req, start: int, n: int) -> EmbedRows | None:
        """The rows its pooling reads of ``req`` computing its tokens ``[start, start + n)``;
        None when it reads none of them (or generates)."""
        done = start + n == req.seq_len
        if req.pooling == "mean":
            return cls(req, n, carry=start > 0, done=done)
        if req.pooling == "last" and done:
            return cls(req, 1, carry=False, done=True)
        return None


class EmbeddingPooling:
    def __init__(self, config: EmbeddingConfig, transfer: HostTransfer):
        self.pooler = Pooler(config.pooling, config.normalize)
        self.transfer = transfer

    def pool(self, hidden: torch.Tensor, rows: list[EmbedRows]) -> HostCopy | None:
        """Pool a step's ``hidden`` rows (its logits rows: ``rows``' and no others,
        the scheduler admits nothing else to an embedding model); the embeddings of
        the prompts it ends, in order, on their way to the host (None: it ends none)."""
        reduced = self.pooler.reduce(hidden, self.transfer.to_device([p.count for p in rows]))
        done = []
        for i, p in enumerate(rows):
            if p.carry:
                reduced[i] += p.req.pooled
            if p.done:
                done.append(i)
            else:
                p.req.pooled = reduced[i]
        if not done:
            return None
        lengths = self.transfer.to_device([rows[i].req.seq_len for i in done])
        return self.transfer.to_host(self.pooler.finish(reduced[self.transfer.to_device(done)], lengths))
