"""llguidance: the second built-in grammar backend (``--grammar-backend llguidance``)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from radixserve.structured_output.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    GrammarTokenizer,
)
from radixserve.structured_output.common import choices, missing_module, schema_text

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON without free whitespace, as the xgrammar backend emits it.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: Any):
        self._m = matcher

    def accept_token(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class LLGuidanceCompiled(CompiledGrammar):
    def __init__(self, tokenizer: Any, grammar: str):
        self._tokenizer, self._grammar = tokenizer, grammar

    def matcher(self) -> GrammarMatcher:
        from llguidance import LLMatcher

        return LLGuidanceMatcher(LLMatcher(self._tokenizer, self._grammar))


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    priority = 0

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        return missing_module("llguidance", "llguidance")

    def __init__(self, tokenizer: GrammarTokenizer):
        from llguidance.hf import from_tokenizer

        self._tokenizer = from_tokenizer(
            tokenizer.tokenizer, n_vocab=tokenizer.vocab_size, eos_token=list(tokenizer.eos_token_ids)
        )

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        from llguidance import LLMatcher, grammar_from

        try:
            if spec.kind in ("json_schema", "json_object"):
                grammar = LLMatcher.grammar_from_json_schema(schema_text(spec), defaults=_JSON_OPTIONS)
            elif spec.kind == "choice":
                grammar = grammar_from("choice", json.dumps(choices(spec)))
            else:
                grammar = grammar_from("ebnf" if spec.kind == "ebnf" else "regex", spec.text)
        except GrammarError:
            raise
        except ValueError as exc:  # not JSON, or an EBNF the converter cannot read
            raise GrammarError(str(exc).strip()) from exc
        error = LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(error.strip())
        return LLGuidanceCompiled(self._tokenizer, grammar)
