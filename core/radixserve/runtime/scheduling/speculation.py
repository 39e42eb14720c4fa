"""Speculative decoding, the scheduler's part: which running requests are given
proposals in a decode step, how many, and the proposer (a plugin, chosen by
``--speculative-algorithm``) that makes them.

Speculation is for small batches: a decode step at batch 1 reads every weight
to make one token per request, so computing a few proposed positions more costs
little; a large batch is bound by compute, where those positions cost as much
as real ones. Above ``--speculative-max-batch-size`` running requests the step
decodes one token each.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from radixserve.config import ServerArgs
from radixserve.registry import PluginRegistry
from radixserve.runtime.execution.draft_model import DraftModelRunner
from radixserve.runtime.execution.eagle_head import EagleHeadRunner
from radixserve.runtime.execution.model_runner import ModelRunner
from radixserve.runtime.execution.request import Req
from radixserve.speculative.base import DraftRequest, Proposer, ProposerSettings, model_path_error

logger = logging.getLogger(__name__)


class Speculation:
    def __init__(
        self, proposer: Proposer, max_batch_size: int, vocab_size: int, draft_model: DraftModelRunner | None = None
    ):
        self.proposer = proposer
        self.num_draft_tokens = proposer.settings.num_draft_tokens
        self.max_batch_size = max_batch_size
        self.vocab_size = vocab_size
        self.draft_model = draft_model
        # An EAGLE head reads the target's hidden states of every token it computes (``take_features``).
        self.eagle_head = draft_model if isinstance(draft_model, EagleHeadRunner) else None

    @classmethod
    def create(cls, args: ServerArgs, registry: PluginRegistry, target: ModelRunner) -> Speculation | None:
        """The part ``args`` asks for (with its draft model, loaded beside ``target``,
        for a proposer that runs one); None when speculation is off."""
        if args.speculative_algorithm is None:
            return None
        proposer_cls = registry.proposer(args.speculative_algorithm)
        draft_path = args.speculative_draft_model_path
        error = model_path_error(args.speculative_algorithm, proposer_cls, draft_path, args.speculative_eagle_path)
        if error is not None:
            raise ValueError(error)
        draft_model: DraftModelRunner | None = None
        if draft_path is not None:
            draft_model = DraftModelRunner(args, registry, target, draft_path)
        elif proposer_cls.needs_eagle_head:
            draft_model = EagleHeadRunner(args, registry, target)
        settings = ProposerSettings(
            num_draft_tokens=args.speculative_num_draft_tokens,
            ngram_min_match=args.speculative_ngram_min_match_window_size,
            ngram_max_match=args.speculative_ngram_max_match_window_size,
            draft_model=draft_model,
        )
        proposer = proposer_cls(settings)
        logger.info(
            "speculative decoding: %s, up to %d tokens proposed a step while at most %d requests decode",
            proposer.name,
            settings.num_draft_tokens,
            args.speculative_max_batch_size,
        )
        return cls(proposer, args.speculative_max_batch_size, target.vocab_size, draft_model)

    def describe(self) -> dict[str, Any]:
        """What ``/server_info`` says of it (the counts of what it proposed and what was
        kept are in the scheduler's stats)."""
        return {
            "algorithm": self.proposer.name,
            "num_draft_tokens": self.num_draft_tokens,
            "max_batch_size": self.max_batch_size,
            "draft_model": self.draft_model.describe() if self.draft_model is not None else None,
        }

    def proposals(self, running: list[Req]) -> list[list[int]] | None:
        """Each running request's proposals, in order; None when this step decodes
        without any (too many requests running, or nothing proposed)."""
        if not self.speculates_at(len(running)):
            return None
        limits = [self._limit(r) for r in running]
        if not any(limits):
            return None
        asked = [DraftRequest(r.rid, r.fill_ids, n) for r, n in zip(running, limits, strict=True) if n > 0]
        made = self.proposer.propose(asked)
        if len(made) != len(asked):
            raise ValueError(
                f"speculative proposer {self.proposer.name!r} returned {len(made)} proposals for {len(asked)} requests"
            )
        proposals = iter(made)
        out = [self._checked(next(proposals), n) if n else [] for n in limits]
        return out if any(out) else None

    def forget(self, rid: str) -> None:
        self.proposer.forget(rid)

    @property
    def reads_hidden_states(self) -> bool:
        """Whether the target's steps must keep their hidden states for ``take_features``."""
        return self.eagle_head is not None

    def speculates_at(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch_size

    def take_features(self, req: Req, start: int, hidden_states: torch.Tensor, speculating: bool) -> None:
        """The target computed and kept ``req``'s tokens at positions ``[start, start +
        len(hidden_states))``: the EAGLE head reads their hidden states. ``speculating``:
        whether the running batch is small enough to speculate (``speculates_at``); if
        not, the head keeps only the newest of a request's waiting features."""
        head = self.eagle_head
        if head is not None and head.take_features(req.rid, start, hidden_states):
            if speculating:
                head.catch_up(req.rid, req.fill_ids)
            else:
                head.trim(req.rid)

    def _limit(self, req: Req) -> int:
        """How many tokens ``req`` may be proposed: up to ``num_draft_tokens``, leaving
        room within its ``max_new_tokens`` for the token the model makes after them."""
        return max(0, min(self.num_draft_tokens, req.remaining_new_tokens - 1))

    def _checked(self, tokens: list[int], limit: int) -> list[int]:
        name = self.proposer.name
        if len(tokens) > limit:
            raise ValueError(f"speculative proposer {name!r} proposed {len(tokens)} tokens where {limit} were asked")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"speculative proposer {name!r} proposed token ids outside the vocabulary: {bad[:4]}")
        return tokens
