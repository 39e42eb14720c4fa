"""Runs a step's model forward and sampling, either inline or, with overlap
scheduling, on one background thread so that the scheduler prepares the next
step (and digests the previous one) while this one computes.

Steps run strictly in launch order, so a step may read what the one before it
wrote on the device: the KV it stored and the tokens it sampled into the
token table. The scheduler touches neither the sampler nor a launched step's
inputs until the step is done.

Running a step only queues its work: the sampled tokens come back through
asynchronous host copies (radixserve/transfer.py), so the worker thread goes
on to queue the next step while the device still computes this one, and the
scheduler waits for a step's tokens only when it digests them
(``PendingStep.wait``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

import torch

from radixserve.cache.memory_pool import ReqToTokenPool
from radixserve.forward_batch import ForwardMode
from radixserve.runtime.execution.batch import BatchPlan, LogitsRows, PromptLogprobRows
from radixserve.runtime.execution.model_runner import ModelRunner
from radixserve.runtime.execution.pooling import EmbeddingPooling, EmbedRows
from radixserve.runtime.execution.request import HoldsKV, Req
from radixserve.runtime.execution.sampler import Sampler
from radixserve.runtime.execution.verifier import NO_PROPOSAL, verify_rows
from radixserve.structured_output.backend import TokenMask
from radixserve.transfer import HostCopy, HostTransfer

# One PromptLogprobRows' logprobs: the targets' values and, per row, the top (logprob, token id) pairs.
PromptLogprobs = tuple[list[float], list[list[tuple[float, int]]]]


@dataclass
class StepWork:
    """Everything a step needs, fixed when it is launched."""

    batch: BatchPlan  # built into a ForwardBatch on the worker, in launch order
    sample_reqs: list[Req]  # requests that get a token this step, in logits-row order
    sample_rows: list[int]  # their rows in the logits
    pool_rows: list[int]  # their rows in the token table (a request may be released meanwhile)
    output_lens: list[int]  # tokens each of them generated before this one
    positions: list[int]  # where each new token goes in its request's token row
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)
    token_mask: TokenMask | None = None  # grammar constraints of the sampled rows (structured output)
    embed_rows: list[EmbedRows] = field(
        default_factory=list
    )  # what embedding requests pool (runtime/execution/pooling.py)
    # A verify step (speculative decoding): per sampled row, the proposal it judges
    # (verifier.NO_PROPOSAL for none); a request then has a row per position computed.
    proposed: list[int] | None = None

    @classmethod
    def of(cls, batch: BatchPlan, logits: LogitsRows, token_mask: TokenMask | None = None) -> StepWork:
        """The work of a launched batch, whose requests' ``kv_len`` already counts its
        tokens: a sampled token goes to position ``kv_len`` of its request (the first
        not yet computed), and the tokens generated before it are the ones past the prompt."""
        reqs = logits.sample_reqs
        held = cast("list[HoldsKV]", reqs)  # launched requests hold KV
        positions = [r.kv.kv_len for r in held]
        output_lens = [p - len(r.origin_input_ids) for r, p in zip(reqs, positions, strict=True)]
        pool_rows = [r.kv.row for r in held]
        return cls(
            batch, reqs, logits.sample_rows, pool_rows, output_lens, positions, logits.prompt, token_mask, logits.embed
        )

    @classmethod
    def verify(
        cls,
        batch: BatchPlan,
        reqs: list[Req],
        logits: LogitsRows,
        proposals: list[list[int]],
        token_mask: TokenMask | None = None,
    ) -> StepWork:
        """The work of a verify step (``logits``: ``LogitsRows.verify``'s), whose requests
        each compute their newest token and ``proposals[i]`` after it: a request's row
        ``j`` makes its ``j``-th token after the newest and judges ``proposals[i][j]``."""
        pool_rows, output_lens, positions, proposed = [], [], [], []
        for req, drafts in zip(cast("list[HoldsKV]", reqs), proposals, strict=True):
            newest = req.kv.kv_len - len(drafts) - 1  # its position (kv_len counts this step's tokens)
            prompt = len(cast(Req, req).origin_input_ids)
            for j in range(len(drafts) + 1):
                pool_rows.append(req.kv.row)
                positions.append(newest + 1 + j)
                output_lens.append(newest + 1 + j - prompt)
                proposed.append(drafts[j] if j < len(drafts) else NO_PROPOSAL)
        return cls(
            batch,
            logits.sample_reqs,
            logits.sample_rows,
            pool_rows,
            output_lens,
            positions,
            [],
            token_mask,
            [],
            proposed,
        )


@dataclass
class LaunchedStep:
    """A step handed to the worker: its requests, each one's ``kv_len`` once the
    step is done, and (after it is awaited) its result."""

    mode: ForwardMode
    reqs: list[Req]
    work: StepWork
    future: Future[PendingStep]
    kv_after: list[int]
    prompt_done: list[Req] = field(default_factory=list)  # whose prompt this step completes
    result: StepResult | None = None
    proposals: list[list[int]] | None = None  # a verify step's, per request (speculative decoding)


@dataclass
class StepResult:
    """A step's outcome on the host, row ``i`` for ``StepWork.sample_reqs[i]``."""

    next_token_ids: list[int]
    chosen_logprobs: list[float] | None
    top_logprobs: list[list[tuple[float, int]]]  # per row, the request's own top_logprobs_num
    prompt_logprobs: list[PromptLogprobs]  # per PromptLogprobRows: values, tops
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # by rid, of the prompts the step ended
    # A verify step's: per row, whether its proposal was kept, and the proposal's raw logprob.
    kept: list[bool] | None = None
    proposal_logprobs: list[float] | None = None
    # With ``ModelWorker.keep_hidden_states``: the final hidden state of each of the step's
    # tokens, in the batch's order, on the device (an EAGLE head reads them).
    hidden_states: torch.Tensor | None = None


@dataclass
class PendingStep:
    """A queued step's outcome: its sampled tokens (and logprobs) on their way to the host."""

    sample_reqs: list[Req]
    prompt_logprobs: list[PromptLogprobs]
    copies: HostCopy | None = None  # next ids[, chosen logprobs][, top values, top ids]
    has_chosen: bool = False
    has_top: bool = False
    verified: bool = False  # a verify step's: kept[, proposal logprobs] follow the ids
    embedded: list[Req] = field(default_factory=list)  # whose embeddings are on their way
    embeddings: HostCopy | None = None
    hidden_states: torch.Tensor | None = None

    def wait(self) -> StepResult:
        vectors = self.embeddings.wait()[0].tolist() if self.embeddings is not None else []
        embeddings = {req.rid: vector for req, vector in zip(self.embedded, vectors, strict=True)}
        if self.copies is None:
            return StepResult([], None, [], self.prompt_logprobs, embeddings, hidden_states=self.hidden_states)
        host = iter(self.copies.wait())
        next_ids = next(host).tolist()
        kept = next(host).tolist() if self.verified else None
        chosen = next(host).tolist() if self.has_chosen else None
        proposal_logprobs = next(host).tolist() if self.verified and self.has_chosen else None
        tops: list[list[tuple[float, int]]] = [[] for _ in self.sample_reqs]
        if self.has_top:
            values, ids = next(host).tolist(), next(host).tolist()
            for i, req in enumerate(self.sample_reqs):
                if req.return_logprob:
                    k = req.top_logprobs_num
                    tops[i] = list(zip(values[i][:k], ids[i][:k], strict=True))
        return StepResult(
            next_ids, chosen, tops, self.prompt_logprobs, embeddings, kept, proposal_logprobs, self.hidden_states
        )


class ModelWorker:
    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        pool: ReqToTokenPool,
        transfer: HostTransfer,
        overlap: bool,
        keep_hidden_states: bool = False,
    ):
        self.runner, self.sampler, self.pool, self.transfer = runner, sampler, pool, transfer
        self.keep_hidden_states = keep_hidden_states  # each step's hidden states in its result (an EAGLE head's)
        self.pooling = EmbeddingPooling(runner.embedding, transfer) if runner.embedding is not None else None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-worker") if overlap else None

    @property
    def overlaps(self) -> bool:
        return self._thread is not None

    def launch(self, work: StepWork) -> Future[PendingStep]:
        """Queue the step; its ``PendingStep`` (or exception) arrives through the future."""
        if self._thread is not None:
            return self._thread.submit(self._run, work)
        future: Future[PendingStep] = Future()
        try:
            future.set_result(self._run(work))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def _run(self, work: StepWork) -> PendingStep:
        batch = work.batch.build(self.pool, self.runner.kv_pool)
        batch.capture_hidden = self.keep_hidden_states
        logits = self.runner.forward(batch)
        prompt = [
            self.sampler.prompt_logprobs(logits[p.row : p.row + len(p.targets)], p.targets, p.req.top_logprobs_num)
            for p in work.prompt_rows
        ]
        pending = PendingStep(work.sample_reqs, prompt, hidden_states=batch.hidden_states)
        if work.embed_rows:  # an embedding model: the logits are its final hidden states
            pending.embedded = [rows.req for rows in work.embed_rows if rows.done]
            pooling = cast(EmbeddingPooling, self.pooling)  # set for an embedding model
            pending.embeddings = pooling.pool(logits, work.embed_rows)
        if not work.sample_reqs:
            return pending
        to_device = self.transfer.to_device
        if work.sample_rows != list(range(logits.shape[0])):
            logits = logits[to_device(work.sample_rows)]
        if work.proposed is not None:
            return self._verify(work, logits, pending)
        out = self.sampler.sample(work.sample_reqs, logits, work.output_lens, work.token_mask)
        # The token table gets the new tokens on the device first: the next step reads them there.
        self.pool.append_tokens(to_device(work.pool_rows), to_device(work.positions), out.next_token_ids)
        results = [out.next_token_ids]
        if out.chosen_logprobs is not None:
            results.append(out.chosen_logprobs)
            pending.has_chosen = True
        if out.top_logprobs is not None:  # one host copy for the batch
            results += [out.top_logprobs.values, out.top_logprobs.ids]
            pending.has_top = True
        pending.copies = self.transfer.to_host(*results)
        return pending

    def _verify(self, work: StepWork, logits: torch.Tensor, pending: PendingStep) -> PendingStep:
        """A verify step's outcome: which proposals were kept and each row's token. The
        scheduler writes the tokens it keeps into the token table (it knows which)."""
        proposed = cast("list[int]", work.proposed)  # a verify step's
        out = verify_rows(self.sampler, work.sample_reqs, logits, work.output_lens, proposed, work.token_mask)
        results = [out.tokens, out.kept]
        pending.verified = True
        if out.token_logprobs is not None and out.proposal_logprobs is not None:
            results += [out.token_logprobs, out.proposal_logprobs]
            pending.has_chosen = True
        if out.top_logprobs is not None:
            results += [out.top_logprobs.values, out.top_logprobs.ids]
            pending.has_top = True
        pending.copies = self.transfer.to_host(*results)
        return pending
