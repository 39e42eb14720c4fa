"""Verification of proposed tokens (speculative decoding): one step's logits, a
row per position computed, -> for each row whether the proposal it judges is
kept and the token the target makes there instead.

A request with proposals ``d1..dk`` has ``k + 1`` rows: row ``j`` holds the
target's logits after ``d1..dj`` and judges ``d(j+1)``; row ``k`` judges nothing.
Each row is adjusted as a decode step's row is (``sampler.adjusted_logits``,
with its own output position for ``min_new_tokens`` and a seeded request's
generator), then:

- a greedy row keeps its proposal when it is the row's argmax, and its token is
  the argmax, so the kept run plus the token after it are exactly the tokens
  decoding one at a time would make;
- a sampled row keeps its proposal ``d`` with probability ``p(d)`` (the
  target's distribution after temperature, top-k/p and min-p; a proposal is a
  point mass, so this is the rejection rule ``min(1, p/q)``), and its token is
  drawn from ``p`` with ``d`` removed: then every token comes from ``p``, as
  without speculation.

The scheduler walks each request's rows (``walk``): the proposals kept up to the
first one refused, then that row's token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.kernels.elementwise import apply_token_bitmask
from radixserve.runtime.execution.sampler import (
    MaskLogits,
    Sampler,
    SamplingBatch,
    SamplingRequest,
    TokenStats,
    TopLogprobs,
    adjusted_logits,
    compute_logprobs,
    sampling_probs,
    step_generator,
)
from radixserve.sampling.params import SamplingParams
from radixserve.structured_output.backend import TokenMask
from radixserve.transfer import HostTransfer

NO_PROPOSAL = -1


@dataclass
class VerifyOutput:
    """Per row: whether its proposal is kept, and its own token (on the device)."""

    kept: torch.Tensor  # [R] bool (False where the row judges no proposal)
    tokens: torch.Tensor  # [R] int64
    token_logprobs: torch.Tensor | None = None  # [R] float32, raw logprob of ``tokens``
    proposal_logprobs: torch.Tensor | None = None  # [R] float32, raw logprob of the proposal judged
    top_logprobs: TopLogprobs | None = None


def verify(
    logits: torch.Tensor,
    batch: SamplingBatch,
    proposed: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    transfer: HostTransfer | None = None,
    mask_logits: MaskLogits = apply_token_bitmask,
) -> VerifyOutput:
    """``logits`` [R, V], ``batch`` a row each (``output_lens``: the tokens before each
    row's own), ``proposed[r]`` the token row ``r`` judges (``NO_PROPOSAL`` for none)."""
    transfer = transfer or HostTransfer(logits.device)
    raw = logits.float()
    x = adjusted_logits(raw, batch, transfer, mask_logits)
    proposal = transfer.to_device(proposed)
    judged = proposal >= 0
    proposal = proposal.clamp(min=0)
    tokens = x.argmax(dim=-1)
    kept = judged & (tokens == proposal)
    sampled = [i for i, p in enumerate(batch.params) if not p.is_greedy]
    if sampled:
        rows = transfer.to_device(sampled)
        kept[rows], tokens[rows] = _rejection_sample(
            x[rows],
            [batch.params[i] for i in sampled],
            [batch.output_lens[i] for i in sampled],
            proposal[rows],
            judged[rows],
            [proposed[i] != NO_PROPOSAL for i in sampled],
            generator,
            transfer,
        )
    out = VerifyOutput(kept, tokens)
    if return_logprob or top_logprobs_num > 0:
        out.token_logprobs, out.top_logprobs = compute_logprobs(raw, tokens, top_logprobs_num)
        out.proposal_logprobs, _ = compute_logprobs(raw, proposal)
    return out


def verify_rows(
    sampler: Sampler,
    rows: Sequence[SamplingRequest],
    logits: torch.Tensor,
    output_lens: Sequence[int],
    proposed: Sequence[int],
    token_mask: TokenMask | None = None,
) -> VerifyOutput:
    """``verify`` with the scheduler's sampler: its generator, grammar masking and the
    token counts of requests with penalties. A request's row ``j`` counts its first
    ``j`` proposals as outputs too. A request with one row has its token counted here,
    as a decode step's is; one with proposals has what it keeps counted from its
    output list at its next step (``Sampler.token_stats``)."""
    stats: list[TokenStats | None] = []
    alone: list[bool] = []  # the request's only row
    start = 0
    while start < len(rows):
        request, count = rows[start], 1
        while start + count < len(rows) and rows[start + count] is request:
            count += 1
        base = sampler.token_stats(request)
        for j in range(count):
            stats.append(base.with_tokens(proposed[start : start + j]) if base is not None and j else base)
            alone.append(count == 1)
        start += count
    batch = SamplingBatch(
        params=[r.sampling_params for r in rows],
        output_lens=list(output_lens),
        token_stats=stats,
        eos_token_ids=sampler.eos_token_ids,
        token_mask=token_mask,
    )
    out = verify(
        logits,
        batch,
        proposed,
        generator=sampler.generator,
        return_logprob=any(r.return_logprob for r in rows),
        top_logprobs_num=max((r.top_logprobs_num for r in rows if r.return_logprob), default=0),
        transfer=sampler.transfer,
        mask_logits=sampler.mask_logits,
    )
    for r, s in enumerate(stats):
        if s is not None and alone[r]:
            s.add(out.tokens[r])
    return out


def _rejection_sample(
    x: torch.Tensor,
    params: list[SamplingParams],
    steps: list[int],
    proposal: torch.Tensor,
    judged: torch.Tensor,
    judging: list[bool],
    generator: torch.Generator | None,
    transfer: HostTransfer,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``judged`` on the device, ``judging`` the same on the host (no device read)."""
    probs = sampling_probs(x, params, transfer)
    column = proposal.unsqueeze(1)
    p_proposal = probs.gather(1, column).squeeze(1)
    # A refused proposal's row draws from p without it (renormalised by multinomial); a
    # proposal of probability 1 is never refused, and its row's draw is never used.
    residual = torch.where(judged.unsqueeze(1), probs.scatter(1, column, 0.0), probs)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
    uniforms = torch.empty(len(params), dtype=probs.dtype, device=probs.device)
    tokens = torch.empty(len(params), dtype=torch.int64, device=probs.device)
    unseeded = [j for j, p in enumerate(params) if p.seed is None]
    if unseeded:
        rows = transfer.to_device(unseeded)
        uniforms[rows] = torch.rand(len(unseeded), generator=generator, device=probs.device, dtype=probs.dtype)
        tokens[rows] = torch.multinomial(residual[rows], 1, generator=generator).squeeze(1)
    for j, p in enumerate(params):
        if p.seed is not None:
            # A row that judges nothing draws as a decode step's row does (its token the same).
            g = step_generator(p.seed, steps[j], probs.device)
            if judging[j]:
                uniforms[j] = torch.rand(1, generator=g, device=probs.device, dtype=probs.dtype)[0]
            tokens[j] = torch.multinomial(residual[j], 1, generator=g)[0]
    return judged & (uniforms < p_proposal), tokens


@dataclass
class VerifiedTokens:
    """What one request gets from a verify step: its kept proposals, then the token of
    the first row that refused one (or of its last row), each with its logprobs when
    the request returns them."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]]]

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


def walk(
    first_row: int,
    proposals: Sequence[int],
    kept: Sequence[bool],
    tokens: Sequence[int],
    token_logprobs: Sequence[float] | None,
    proposal_logprobs: Sequence[float] | None,
    top_logprobs: Sequence[list[tuple[float, int]]],
) -> VerifiedTokens:
    """The tokens of the request whose rows start at ``first_row``."""
    out = VerifiedTokens([], [], [])
    for j, proposal in enumerate(proposals):
        row = first_row + j
        if not kept[row]:
            break
        out.tokens.append(proposal)
        out.logprobs.append(proposal_logprobs[row] if proposal_logprobs is not None else None)
        out.top_logprobs.append(top_logprobs[row] if top_logprobs else [])
    row = first_row + len(out.tokens)
    out.tokens.append(tokens[row])
    out.logprobs.append(token_logprobs[row] if token_logprobs is not None else None)
    out.top_logprobs.append(top_logprobs[row] if top_logprobs else [])
    return out
