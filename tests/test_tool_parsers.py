"""Tool parsers and reasoning parsers on fixed strings: whole, and streamed char
by char and in chunks of 4 (the streamed pieces must add up to the whole)."""

from __future__ import annotations

import json

import pytest

from radixserve.grammar import GatedMatcher, GrammarMatcher, ReasoningGate, allocate_token_bitmask
from radixserve.registry import PluginRegistry
from radixserve.server.reasoning import ReasoningParser
from radixserve.tool_parsers.tagged_json import HermesToolParser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]
CASES = [
    ("plain text, no call", "plain text, no call", []),
    (
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n'
        '</tool_call>\n<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>',
        "I will check.\n\n",
        [("get_weather", {"city": "Paris", "n": [1, {"a": "}"}]}), ("add", {"x": 1})],
    ),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call> after', None, []),  # unknown: content
    ('<tool_call>{"name": "add", "arguments": {"x"', None, []),  # unfinished: content
    ('<tool_call>{"name": "add"}</tool_call>', "", [("add", {})]),
    ("a < b <tool_ca", None, []),
]


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_hermes_whole(text, content, calls):
    out = HermesToolParser(TOOLS).parse(text)
    assert out.content == (text if content is None else content)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("text,content,calls", CASES)
def test_hermes_streamed(text, content, calls, size):
    parser = HermesToolParser(TOOLS)
    deltas = [parser.feed(piece) for piece in chunks(text, size)] + [parser.finish()]
    streamed_content = "".join(d.content for d in deltas)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        for c in d.calls:
            if c.name is not None:
                assert c.index not in names  # the name comes once, first
                names[c.index] = c.name
            assert c.index in names
            args[c.index] = args.get(c.index, "") + c.arguments
    if text.startswith('<tool_call>{"name": "add", "arguments": {"x"'):
        # Cut short inside a call: the stream told the call's start (it cannot take it back); whole, it is content.
        assert streamed_content == "" and names == {0: "add"} and args[0] == '{"x"'
        return
    assert streamed_content == (text if content is None else content)
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == calls


REASONING = [
    ("qwen3", "<think>\nhmm</think>\n\n{}", "\nhmm", "\n\n{}"),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "no reasoning <think>x</think>", None, "no reasoning <think>x</think>"),
    ("qwen3", "<think>unfinished", "unfinished", ""),
    ("qwen3", "<thi", None, "<thi"),
    ("deepseek-r1", "reasoned</think>answer", "reasoned", "answer"),
    ("deepseek-r1", "<think>r</think>a</think>", "r", "a</think>"),
    ("deepseek-r1", "still thinking </thi", "still thinking </thi", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_reasoning_split(name, text, reasoning, content, size):
    assert ReasoningParser(name).parse(text) == (reasoning, content)
    parser = ReasoningParser(name)
    pieces = [parser.feed(p) for p in chunks(text, size)] + [parser.finish()]
    assert "".join(r for r, _ in pieces) == (reasoning or "")
    assert "".join(c for _, c in pieces) == content


class Digits(GrammarMatcher):
    """A toy grammar: exactly two tokens below 10."""

    def __init__(self):
        self.seen = 0

    def accept_token(self, token):
        if token >= 10 or self.seen >= 2:
            return False
        self.seen += 1
        return True

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        if self.seen < 2:
            bitmask[row, 0] = (1 << 10) - 1

    def is_terminated(self):
        return self.seen == 2

    def rollback(self, num_tokens):
        self.seen -= num_tokens


def allowed(m: GrammarMatcher, vocab: int = 64) -> set[int]:
    mask = allocate_token_bitmask(1, vocab)
    m.fill_bitmask(mask, 0)
    return {t for t in range(vocab) if (int(mask[0, t // 32]) >> (t % 32)) & 1}


def test_gated_matcher_reasoning_then_grammar():
    gate = ReasoningGate(start_ids=(40, 41), end_ids=(50, 51))
    m = GatedMatcher(Digits(), gate)
    assert allowed(m) == set(range(10)) | {40}
    assert m.accept_token(40) and allowed(m) == {41} and not m.accept_token(3)
    assert m.accept_token(41) and allowed(m) == set(range(64))
    for t in (20, 50, 33, 50, 51):
        assert m.accept_token(t)
    assert allowed(m) == set(range(10)) and not m.is_terminated()
    assert m.accept_token(1) and m.accept_token(2) and m.is_terminated()
    m.rollback(3)  # back into the reasoning, before its end tag's last token
    assert allowed(m) == set(range(64)) and m.inner.seen == 0
    # No reasoning: the grammar straight away.
    m = GatedMatcher(Digits(), gate)
    assert m.accept_token(5) and allowed(m) == set(range(10))
    # DeepSeek-R1: reasoning from the start.
    m = GatedMatcher(Digits(), ReasoningGate((40,), (50,), starts_in_reasoning=True))
    assert allowed(m) == set(range(64)) and m.accept_token(50) and allowed(m) == set(range(10))
    # Bit 31 (the sign bit of an int32 word) is set correctly.
    m = GatedMatcher(Digits(), ReasoningGate((63,), (50,)))
    assert 63 in allowed(m)


def test_tool_parser_kind_is_registered():
    registry = PluginRegistry(load_entry_points=False)
    assert registry.tool_parser() is HermesToolParser
    assert registry.tool_parser(None, "{% if tools %}<tool_call>{% endif %}") is HermesToolParser
    with pytest.raises(Exception, match="unknown tool call parser 'nope'"):
        registry.tool_parser("nope")
