"""The EAGLE proposer: an EAGLE head (``--speculative-eagle-path``, EAGLE-1/2's
checkpoint layout) drafts ``num_draft_tokens`` tokens greedily after each
request's newest token, reading the target model's hidden states.

The runtime runs the head (runtime/execution/eagle_head.py) and feeds it the
target's features after every target step; to the proposer it is a
``SequenceModel`` like a draft model, asked for one drafted token at a time,
so the drafting loop is the draft proposer's. A head costs about one decoder
layer of the target per drafted position, where a draft model costs its own
depth.
"""

from __future__ import annotations

from radixserve.speculative.draft import DraftModelProposer


class EagleProposer(DraftModelProposer):
    name = "eagle"
    priority = 6
    needs_draft_model = False
    needs_eagle_head = True
