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

Proposers here are deterministic: a proposal is a list of tokens, taken as a
point mass (the rejection rule then accepts a proposal ``d`` with the target's
probability of ``d``). One whose drafts are sampled from a distribution of its
own would also return that distribution; the verifier's rule has the place for
it (``draft_probs``), this contract does not yet.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ProposerSettings:
    """What ``--speculative-*`` says, passed to a proposer when it is built."""

    num_draft_tokens: int = 4  # the most tokens proposed for one request in one step
    ngram_min_match: int = 1  # n-gram: the shortest suffix looked up
    ngram_max_match: int = 12  # n-gram: the longest suffix looked up


@dataclass(frozen=True)
class DraftRequest:
    """One running request as a proposer sees it: ``token_ids`` is its prompt and its
    output so far (the last one is the newest token, whose successors are proposed);
    ``max_tokens`` the most it may be proposed this step (at most ``num_draft_tokens``,
    fewer near its ``max_new_tokens``)."""

    rid: str
    token_ids: Sequence[int]
    max_tokens: int


class Proposer(ABC):
    """Proposes tokens for running requests. One instance serves one scheduler (one
    tensor-parallel rank runs its own, on the same requests: it must propose alike on
    every rank, so it must be deterministic)."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0

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
