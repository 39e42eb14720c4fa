"""xgrammar (0.2.x): the default grammar backend."""

from __future__ import annotations

import json
from typing import Any

import torch

from radixserve.grammar import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    GrammarTokenizer,
)
from radixserve.grammar_backends.common import choices, missing_module, schema_text


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any):
        self._m = matcher

    def accept_token(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: Any):
        self._compiled = compiled

    def matcher(self) -> GrammarMatcher:
        import xgrammar

        return XGrammarMatcher(xgrammar.GrammarMatcher(self._compiled))


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"
    priority = 10

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        return missing_module("xgrammar", "xgrammar")

    def __init__(self, tokenizer: GrammarTokenizer):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer.tokenizer, vocab_size=tokenizer.vocab_size, stop_token_ids=list(tokenizer.eos_token_ids)
        )
        self._compiler = xgrammar.GrammarCompiler(info)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            if spec.kind in ("json_schema", "json_object"):
                # Strict mode (no properties beyond those listed) would read json_object's {"type": "object"} as {}.
                strict = spec.kind == "json_schema"
                compiled = self._compiler.compile_json_schema(
                    schema_text(spec), any_whitespace=False, strict_mode=strict
                )
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.text)
            elif spec.kind == "ebnf":
                compiled = self._compiler.compile_grammar(spec.text)
            else:
                union = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices(spec))
                compiled = self._compiler.compile_grammar(f"root ::= {union}")
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with the parser's message
            raise GrammarError(str(exc).strip()) from exc
        return XGrammarCompiled(compiled)
