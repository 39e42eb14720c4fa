"""xgrammar (0.2.x): the default grammar backend.

JSON grammars (compact: ``any_whitespace=False``) also forbid every token that holds a
raw control character (U+0000-U+001F): no valid JSON text has one there, yet xgrammar
0.2.8 allows them inside a string with ``maxLength``, and a call whose arguments hold
one fails to parse. The forbidden tokens are one bitmask row, ANDed into each fill."""

from __future__ import annotations

import json
from typing import Any

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


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any, allowed: torch.Tensor | None = None):
        self._m = matcher
        self._allowed = allowed  # a bitmask row of the tokens the grammar may ever allow, or None: all

    def accept_token(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._allowed is not None:
            bitmask[row] &= self._allowed

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: Any, allowed: torch.Tensor | None = None):
        self._compiled, self._allowed = compiled, allowed

    def matcher(self) -> GrammarMatcher:
        import xgrammar

        return XGrammarMatcher(xgrammar.GrammarMatcher(self._compiled), self._allowed)


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
        self._no_control = _without_control_characters(info.decoded_vocab, tokenizer.vocab_size)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            allowed = None
            if spec.kind in ("json_schema", "json_object"):
                allowed = self._no_control
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
        return XGrammarCompiled(compiled, allowed)


def _without_control_characters(decoded_vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """A bitmask row (int32, bit ``t % 32`` of word ``t // 32``) of the tokens whose bytes
    hold no control character; tokens past the tokenizer's vocabulary stay allowed (the
    grammar itself never allows them)."""
    allowed = torch.ones(((vocab_size + 31) // 32) * 32, dtype=torch.bool)
    for token, text in enumerate(decoded_vocab[:vocab_size]):
        if any(byte < 0x20 for byte in text):
            allowed[token] = False
    bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32)
    return bits.sum(dim=1).to(torch.int32)  # wraps to the word's two's-complement value
