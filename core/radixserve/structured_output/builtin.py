"""The built-in grammar backends, registered through the same hook as a third
party's (built-in plugin ``radixserve-grammar``): ``xgrammar`` (the default)
and ``llguidance``. Each imports its library only when built, so a missing one
makes that backend unavailable (``radixserve plugins`` says why), not the core."""

from __future__ import annotations

from radixserve.hooks import Register, hookimpl
from radixserve.structured_output.llguidance_backend import LLGuidanceBackend
from radixserve.structured_output.xgrammar_backend import XGrammarBackend


@hookimpl
def register_grammar_backends(register: Register) -> None:
    register(XGrammarBackend)
    register(LLGuidanceBackend)
