"""Structured output without a server: the grammar contract (bitmask), the two
built-in backends on the tiny tokenizer, the registry's --grammar-backend rule,
and how the API reads every spelling of a constraint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from radixserve.kernels import KernelQuery
from radixserve.kernels.elementwise import apply_token_bitmask
from radixserve.registry import PluginError, PluginRegistry
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.structured_output.backend import (
    GrammarBackend,
    GrammarError,
    GrammarSpec,
    GrammarTokenizer,
    allocate_token_bitmask,
)
from radixserve.structured_output.builtin import LLGuidanceBackend, XGrammarBackend
from radixserve.structured_output.request_specs import ConstraintError, grammar_spec
from radixserve_torch.elementwise_cpu import CpuFusedElementwise

BACKENDS = [XGrammarBackend, LLGuidanceBackend]


@pytest.mark.parametrize("backend", ["torch", "cpu_fused"])
def test_apply_token_bitmask_masks_only_the_given_rows(backend: str) -> None:
    """The torch code and the CPU kernel the sampler gets from the ``cpu_fused`` backend."""
    query = KernelQuery(device="cpu", dtype=torch.float32)
    apply = apply_token_bitmask if backend == "torch" else CpuFusedElementwise(query).apply_token_bitmask
    logits = torch.zeros(3, 70)
    bitmask = allocate_token_bitmask(2, 70)
    bitmask[0] = 0
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[1] = 0
    bitmask[1, 2] = 1 << 3  # token 67
    apply(logits, bitmask, torch.tensor([2, 0]))
    assert torch.isfinite(logits[1]).all()  # not constrained
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [67]


@pytest.fixture(scope="module")
def grammar_tokenizer(tiny_tokenizer: PreTrainedTokenizerBase) -> GrammarTokenizer:
    # A logits width above the tokenizer's vocabulary, as padded models have.
    return GrammarTokenizer(tiny_tokenizer, len(tiny_tokenizer) + 13, (tiny_tokenizer.eos_token_id,))


def _walk(backend: GrammarBackend, spec: GrammarSpec, tokenizer: GrammarTokenizer, seed: int) -> str:
    """Sample uniformly among the allowed tokens until the grammar terminates."""
    matcher = backend.compile(spec).matcher()
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(300):
        bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.zeros(1, tokenizer.vocab_size)
        apply_token_bitmask(logits, bitmask, torch.tensor([0]))
        allowed = torch.isfinite(logits[0]).nonzero().flatten()
        assert allowed.max() < len(tokenizer.tokenizer)  # never a token past the tokenizer's vocabulary
        token = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
        assert matcher.accept_token(token)
        ids.append(token)
        if matcher.is_terminated():  # after the EOS (xgrammar), or the grammar's last token (llguidance)
            break
    assert matcher.is_terminated()
    return tokenizer.tokenizer.decode(ids, skip_special_tokens=True)


SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["a", "b"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[xy]{1,3}$"}, "minItems": 1, "maxItems": 2},
    },
    "required": ["kind", "n", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.name)
def test_backends_compile_every_kind(backend_cls: type[GrammarBackend], grammar_tokenizer: GrammarTokenizer) -> None:
    backend = backend_cls(grammar_tokenizer)
    for seed in range(3):
        value = json.loads(_walk(backend, GrammarSpec("json_schema", json.dumps(SCHEMA)), grammar_tokenizer, seed))
        assert value["kind"] in ("a", "b") and 0 <= value["n"] <= 9 and 1 <= len(value["tags"]) <= 2
        text = _walk(backend, GrammarSpec("regex", "(cat|dog)-[0-9]{2}"), grammar_tokenizer, seed)
        assert re.fullmatch("(cat|dog)-[0-9]{2}", text), text
        text = _walk(backend, GrammarSpec("ebnf", 'root ::= "x" | "y" root'), grammar_tokenizer, seed)
        assert re.fullmatch("y*x", text), text
        text = _walk(backend, GrammarSpec("choice", json.dumps(["red", "green blue"])), grammar_tokenizer, seed)
        assert text in ("red", "green blue")
    assert isinstance(json.loads(_walk(backend, GrammarSpec("json_object", ""), grammar_tokenizer, 0)), dict)


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.name)
@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("regex", "(unclosed"),
        GrammarSpec("ebnf", "root ::= ("),
        GrammarSpec("choice", "[]"),
    ],
    ids=lambda s: s.kind,
)
def test_bad_specs_raise_the_compilers_message(
    backend_cls: type[GrammarBackend], spec: GrammarSpec, grammar_tokenizer: GrammarTokenizer
) -> None:
    with pytest.raises(GrammarError) as info:
        backend_cls(grammar_tokenizer).compile(spec)
    assert str(info.value).strip()


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.name)
def test_rollback_undoes_accepted_tokens(
    backend_cls: type[GrammarBackend], grammar_tokenizer: GrammarTokenizer
) -> None:
    tok = grammar_tokenizer.tokenizer
    matcher = backend_cls(grammar_tokenizer).compile(GrammarSpec("regex", "ab|ac")).matcher()
    a, b, c = (tok.convert_tokens_to_ids(ch) for ch in "abc")
    assert matcher.accept_token(a) and matcher.accept_token(b)
    matcher.rollback(1)
    assert matcher.accept_token(c)


def test_registry_grammar_backend_rule(tmp_path: Path) -> None:
    registry = PluginRegistry(load_entry_points=False)
    assert registry.grammar_backend("auto") is XGrammarBackend
    assert registry.grammar_backend("llguidance") is LLGuidanceBackend
    assert registry.grammar_backend("none") is None
    with pytest.raises(PluginError, match="unknown grammar backend 'nope'"):
        registry.grammar_backend("nope")
    rows = registry.report()["backends"]["grammar"]
    assert [r["name"] for r in rows] == ["xgrammar", "llguidance"] and all(r["usable"] for r in rows)


def test_registry_refuses_a_backend_that_cannot_load() -> None:
    class Missing(XGrammarBackend):
        name = "missing"
        priority = 100

        @classmethod
        def unavailable_reasons(cls) -> list[str]:
            return ["the 'missing' package is not installed"]

    class Plugin:
        @staticmethod
        def register_grammar_backends(register):  # type: ignore[no-untyped-def]
            register(Missing)

    from radixserve.hooks import hookimpl

    Plugin.register_grammar_backends = hookimpl(Plugin.register_grammar_backends)
    registry = PluginRegistry(load_entry_points=False)
    registry.register_plugin(Plugin, "missing-grammar")
    with pytest.raises(PluginError, match="cannot load: the 'missing' package is not installed"):
        registry.grammar_backend("auto")  # the highest priority: an error, not a fallback to xgrammar


def test_every_spelling_reads_as_one_spec() -> None:
    schema = {"type": "object"}
    cases = {
        "response_format": ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, "json_schema"),
        "json_schema": (json.dumps(schema), "json_schema"),
        "guided_json": (schema, "json_schema"),
        "regex": ("a+", "regex"),
        "guided_regex": ("a+", "regex"),
        "ebnf": ('root ::= "a"', "ebnf"),
        "guided_grammar": ('root ::= "a"', "ebnf"),
        "guided_choice": (["a", "b"], "choice"),
    }
    for field, (value, kind) in cases.items():
        spec = grammar_spec({field: value})
        assert spec is not None and spec.kind == kind and spec.source == field
    assert grammar_spec({"response_format": {"type": "json_object"}}) == GrammarSpec("json_object", "")
    assert grammar_spec({"response_format": {"type": "text"}}) is None
    spec = grammar_spec({"structured_outputs": {"choice": ["a"]}})
    assert spec is not None and spec.kind == "choice" and spec.source == "structured_outputs.choice"


def test_two_constraints_are_refused_naming_both() -> None:
    with pytest.raises(ConstraintError, match="regex, guided_json"):
        grammar_spec({"regex": "a", "guided_json": {}})
    with pytest.raises(ConstraintError) as info:
        grammar_spec({"structured_outputs": {"regex": "a", "json": {}}})
    assert info.value.param == "structured_outputs.json"


def test_openai_requests_carry_the_grammar() -> None:
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}
    )
    assert chat.sampling_params(8)["grammar"] == GrammarSpec("json_object", "")
    completion = CompletionRequest.model_validate({"prompt": "x", "extra_body": {"guided_regex": "a+"}})
    assert completion.sampling_params(8)["grammar"] == GrammarSpec("regex", "a+")
    assert "grammar" not in CompletionRequest.model_validate({"prompt": "x"}).sampling_params(8)


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.name)
def test_json_never_gets_a_raw_control_character(
    backend_cls: type[GrammarBackend], grammar_tokenizer: GrammarTokenizer
) -> None:
    """Inside a JSON string a raw control character makes the text invalid JSON. xgrammar
    0.2.8 allows them in a string with ``maxLength`` (a call's arguments then fail to
    parse); the backend forbids every token that holds one wherever the grammar is JSON."""
    tok = grammar_tokenizer.tokenizer
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    matcher = backend_cls(grammar_tokenizer).compile(GrammarSpec("json_schema", json.dumps(schema))).matcher()
    for token in tok.encode('{"city": "ab', add_special_tokens=False):
        assert matcher.accept_token(token)
    bitmask = allocate_token_bitmask(1, grammar_tokenizer.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, grammar_tokenizer.vocab_size)
    apply_token_bitmask(logits, bitmask, torch.tensor([0]))
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    control = [t for t in allowed if t < len(tok) and any(ord(c) < 0x20 for c in tok.decode([t]))]
    assert control == [] and tok.convert_tokens_to_ids("a") in allowed
