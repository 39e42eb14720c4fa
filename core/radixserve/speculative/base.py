"""The contract of a speculative proposer (plugin kind ``speculative``, hook
``register_speculative_proposers``).

Each decode step, while speculation is on, the scheduler asks its proposer for
up to ``num_draft_tokens`` tokens that may follow each running request's tokens.
The target model then computes every proposed position in one step and keeps
the longest run of proposals it agrees with (``runtime/execution/verifier.py``):
under greedy decoding exactly the tokens it would have made one at a time, under
sampling tokens drawn from its own distribution. A proposer can therefore never
change what a request gets, only how many steps it takes; a bad proposer costs
speed, not correctness.

Proposers are deterministic: a proposal is a list of tokens, taken as a point
mass (the rejection rule then keeps a proposal ``d`` with the target's
probability of ``d``, and the tokens still follow the target's distribution). A
proposer that runs a model of its own (a draft model) declares
``needs_draft_model``; the runtime then loads ``--speculative-draft-model-path``
beside the target, on the same device, and hands it over as a ``SequenceModel``
in the settings: the proposer asks it for next-token logits, the runtime keeps
each request's KV in the draft model's own pool between calls. A proposer that
declares ``needs_eagle_head`` gets the EAGLE head of ``--speculative-eagle-path``
the same way; the runtime feeds it the target's hidden states, so it asks it
for logits as it would a draft model, one drafted token at a time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch


@dataclass(frozen=True)
class DraftRequest:
    """One running request as a proposer sees it: ``token_ids`` is its prompt and its
    output so far (the last one is the newest token, whose successors are proposed);
    ``max_tokens`` the most it may be proposed this step (at most ``num_draft_tokens``,
    fewer near its ``max_new_tokens``)."""

    rid: str
    token_ids: Sequence[int]
    max_tokens: int


class SequenceModel(Protocol):
    """A model the runtime runs for a proposer (``--speculative-draft-model-path``)."""

    @property
    def vocab_size(self) -> int: ...

    def next_token_logits(self, requests: Sequence[DraftRequest]) -> torch.Tensor:
        """``[len(requests), vocab]`` float32 logits of the token after each request's
        ``token_ids`` (``max_tokens`` is not read). The model keeps each request's KV
        between calls and computes only the tokens past the longest prefix it has
        already computed for that ``rid``, so asking again with the sequence grown by
        a token computes one token, and a sequence that changed in its last tokens
        (refused proposals) is computed from where it changed."""
        ...

    def forget(self, rid: str) -> None:
        """Free what is kept for ``rid``."""
        ...


@dataclass(frozen=True)
class ProposerSettings:
    """What ``--speculative-*`` says, passed to a proposer when it is built."""

    num_draft_tokens: int = 4  # the most tokens proposed for one request in one step
    ngram_min_match: int = 1  # n-gram: the shortest suffix looked up
    ngram_max_match: int = 12  # n-gram: the longest suffix looked up
    draft_model: SequenceModel | None = None  # for a proposer with ``needs_draft_model``


class Proposer(ABC):
    """Proposes tokens for running requests. One instance serves one scheduler (one
    tensor-parallel rank runs its own, on the same requests: it must propose alike on
    every rank, so it must be deterministic)."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    needs_draft_model: ClassVar[bool] = False  # True: built with ``settings.draft_model`` set
    # True: built with ``settings.draft_model`` set to the EAGLE head of ``--speculative-eagle-path``,
    # a SequenceModel that also reads the target's hidden states (the runtime feeds them).
    needs_eagle_head: ClassVar[bool] = False

    def __init__(self, settings: ProposerSettings):
        self.settings = settings

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        """Why this proposer cannot run here (a missing library, ...); empty when it can."""
        return []

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """For each request, in order, up to ``max_tokens`` token ids that may follow its
        ``token_ids`` (an empty list proposes nothing: the request decodes one token)."""

    def forget(self, rid: str) -> None:  # noqa: B027 (a stateless proposer has nothing to forget)
        """Request ``rid`` ended: drop whatever was kept for it."""


def model_path_error(
    algorithm: str, proposer: type[Proposer], draft_model_path: str | None, eagle_path: str | None
) -> str | None:
    """The error for a draft model or EAGLE head missing where the proposer runs one,
    or given where it does not; None when the paths fit it."""
    for flag, needed, given, what in (
        ("speculative_draft_model_path", proposer.needs_draft_model, draft_model_path, "a draft model"),
        ("speculative_eagle_path", proposer.needs_eagle_head, eagle_path, "an EAGLE head"),
    ):
        if needed and given is None:
            return f"{flag}: --speculative-algorithm {algorithm} runs {what}; name one"
        if given is not None and not needed:
            return f"{flag}: --speculative-algorithm {algorithm} runs no {what.split(' ', 1)[1]}; leave it unset"
    return None
