"""The built-in proposers, registered through the same hook as a third party's
(built-in plugin ``radixserve-speculative``): ``ngram``, ``draft`` and ``eagle``."""

from __future__ import annotations

from radixserve.hooks import Register, hookimpl
from radixserve.speculative.draft import DraftModelProposer
from radixserve.speculative.eagle import EagleProposer
from radixserve.speculative.ngram import NgramProposer


@hookimpl
def register_speculative_proposers(register: Register) -> None:
    register(NgramProposer)
    register(DraftModelProposer)
    register(EagleProposer)
