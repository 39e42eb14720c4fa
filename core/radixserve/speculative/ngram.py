"""The n-gram proposer (prompt lookup): where the last ``n`` tokens of a request
occurred before in its own prompt or output, propose the tokens that followed
them there. It pays where an output repeats its input: editing code, quoting,
extracting, summarising with the source's words.

For each request it keeps an index from each n-gram (``ngram_min_match`` <= n <=
``ngram_max_match``) to where that n-gram last ended, extended with the tokens
new since its last call, so a step costs the new tokens and one lookup per n,
not a scan of the sequence. The longest suffix with an earlier occurrence wins;
among occurrences, the latest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.speculative.base import DraftRequest, Proposer, ProposerSettings


@dataclass
class _Index:
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> where it last ended
    indexed: int = 0  # n-grams ending at positions < indexed are in ``ends``


class NgramProposer(Proposer):
    name = "ngram"
    priority = 10

    def __init__(self, settings: ProposerSettings):
        super().__init__(settings)
        if not 1 <= settings.ngram_min_match <= settings.ngram_max_match:
            raise ValueError(
                "speculative_ngram_min_match_window_size: must be >= 1 and at most the max match window "
                f"({settings.ngram_max_match}), got {settings.ngram_min_match}"
            )
        self._indexes: dict[str, _Index] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._propose_one(r) for r in requests]

    def forget(self, rid: str) -> None:
        self._indexes.pop(rid, None)

    def _propose_one(self, request: DraftRequest) -> list[int]:
        if request.max_tokens <= 0:
            return []
        tokens = request.token_ids
        index = self._indexes.setdefault(request.rid, _Index())
        if index.indexed > len(tokens):  # its tokens were cut (never in the scheduler): start over
            index = self._indexes[request.rid] = _Index()
        self._extend(index, tokens)
        low, high = self.settings.ngram_min_match, self.settings.ngram_max_match
        for n in range(min(high, len(tokens) - 1), low - 1, -1):
            end = index.ends.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return list(tokens[end : end + request.max_tokens])
        return []

    def _extend(self, index: _Index, tokens: Sequence[int]) -> None:
        """Index the n-grams that end before the last token (the current suffix's own
        end is left out, so a lookup finds an earlier occurrence)."""
        upto = len(tokens)
        low, high = self.settings.ngram_min_match, self.settings.ngram_max_match
        ends = index.ends
        for end in range(max(index.indexed, low), upto):
            for n in range(low, min(high, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        index.indexed = max(index.indexed, upto)
