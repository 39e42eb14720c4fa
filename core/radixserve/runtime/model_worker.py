"""Runs a step's model forward and sampling, either inline or, with overlap
scheduling, on one background thread so that the scheduler prepares the next
step (and digests the previous one) while this one computes.

Steps run strictly in launch order, so a step may read what the one before it
wrote on the device: the KV it stored and the tokens it sampled into the
token table. The scheduler touches neither the sampler nor a launched step's
inputs until the step is done.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from radixserve.cache.memory_pool import ReqToTokenPool
from radixserve.forward_batch import ForwardBatch
from radixserve.runtime.model_runner import ModelRunner
from radixserve.runtime.req import Req
from radixserve.runtime.sampler import Sampler


@dataclass
class PromptLogprobRows:
    """Logits rows ``[row, row + count)`` score prompt tokens ``targets`` of ``req``."""

    req: Req
    row: int
    targets: list[int]


@dataclass
class StepWork:
    """Everything a step needs, fixed when it is launched."""

    batch: ForwardBatch
    sample_reqs: list[Req]  # requests that get a token this step, in logits-row order
    sample_rows: list[int]  # their rows in the logits
    pool_rows: list[int]  # their rows in the token table (a request may be released meanwhile)
    output_lens: list[int]  # tokens each of them generated before this one
    positions: list[int]  # where each new token goes in its request's token row
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)


@dataclass
class StepResult:
    """A step's outcome on the host, row ``i`` for ``StepWork.sample_reqs[i]``."""

    next_token_ids: list[int]
    chosen_logprobs: Optional[list[float]]
    top_logprobs: list[list[tuple[float, int]]]  # per row, the request's own top_logprobs_num
    prompt_logprobs: list[tuple[list[float], list]]  # per PromptLogprobRows: values, tops


class ModelWorker:
    def __init__(self, runner: ModelRunner, sampler: Sampler, pool: ReqToTokenPool, overlap: bool):
        self.runner, self.sampler, self.pool = runner, sampler, pool
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-worker") if overlap else None

    @property
    def overlaps(self) -> bool:
        return self._thread is not None

    def launch(self, work: StepWork) -> Future:
        """Start the step; its ``StepResult`` (or exception) arrives through the future."""
        if self._thread is not None:
            return self._thread.submit(self._run, work)
        future: Future = Future()
        try:
            future.set_result(self._run(work))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def _run(self, work: StepWork) -> StepResult:
        logits = self.runner.forward(work.batch)
        prompt = [
            self.sampler.prompt_logprobs(logits[p.row : p.row + len(p.targets)], p.targets, p.req.top_logprobs_num)
            for p in work.prompt_rows
        ]
        if not work.sample_reqs:
            return StepResult([], None, [], prompt)
        device = logits.device
        rows = torch.tensor(work.sample_rows, dtype=torch.int64, device=device)
        out = self.sampler.sample(work.sample_reqs, logits[rows], work.output_lens)
        # The token table gets the new tokens on the device first: the next step reads them there.
        self.pool.append_tokens(
            torch.tensor(work.pool_rows, dtype=torch.int64, device=device),
            torch.tensor(work.positions, dtype=torch.int64, device=device),
            out.next_token_ids)
        chosen = out.chosen_logprobs.tolist() if out.chosen_logprobs is not None else None
        tops: list[list[tuple[float, int]]] = [[] for _ in work.sample_reqs]
        if out.top_logprobs is not None:  # one host copy for the batch
            for i, row in enumerate(out.top_logprobs.tolist()):
                req = work.sample_reqs[i]
                tops[i] = row[: req.top_logprobs_num] if req.return_logprob else []
        return StepResult(out.next_token_ids.tolist(), chosen, tops, prompt)
