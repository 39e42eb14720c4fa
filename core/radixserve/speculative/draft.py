"""The draft-model proposer: a smaller model with the target's tokenizer
(``--speculative-draft-model-path``) decodes ``num_draft_tokens`` tokens greedily
after each request's newest token, and those are proposed.

The runtime runs the draft model (``SequenceModel``: its own KV pool beside the
target's, each request's KV kept between steps), so a step here costs one draft
forward per proposed position over the requests still proposing, each computing
one token a request, after the first, which also computes the tokens the verify
step before kept. Greedy drafts are point masses, which the verifier's
rejection rule takes as they are under sampling too.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.speculative.base import DraftRequest, Proposer, ProposerSettings, SequenceModel


class DraftModelProposer(Proposer):
    name = "draft"
    priority = 5
    needs_draft_model = True

    def __init__(self, settings: ProposerSettings):
        super().__init__(settings)
        if settings.draft_model is None:
            raise ValueError(f"the {self.name} proposer runs a model of its own, and none was given")
        self.model: SequenceModel = settings.draft_model

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafted: list[list[int]] = [[] for _ in requests]
        asking = [i for i, r in enumerate(requests) if r.max_tokens > 0]
        while asking:
            sequences = [DraftRequest(requests[i].rid, [*requests[i].token_ids, *drafted[i]], 0) for i in asking]
            tokens = self.model.next_token_logits(sequences).argmax(dim=-1).tolist()
            for i, token in zip(asking, tokens, strict=True):
                drafted[i].append(token)
            asking = [i for i in asking if len(drafted[i]) < requests[i].max_tokens]
        return drafted

    def forget(self, rid: str) -> None:
        self.model.forget(rid)
