"""Tool parsers and the tool_choice required reader on fixed strings and on
random ones (hypothesis): read whole, and streamed cut at every position, char
by char and in random chunks, the streamed pieces must add up to the whole; the
grammar's reasoning gate (reasoning parsers: tests/test_reasoning_parsers.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.registry import PluginRegistry
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.tool_calls import ChoiceReader, RequiredCalls, keeps_special_tokens
from radixserve.structured_output.backend import GatedMatcher, GrammarMatcher, ReasoningGate, allocate_token_bitmask
from radixserve.tool_parsers.base import ToolParser
from radixserve.tool_parsers.hermes import HermesToolParser
from radixserve.tool_parsers.llama3_json import Llama3JSONToolParser
from radixserve.tool_parsers.mistral import MistralToolParser
from radixserve.tool_parsers.pythonic import PythonicToolParser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]
Calls = list[tuple[str, Any]]
# (parser, output, its content (None: all of it), its calls)
CASES: list[tuple[type[ToolParser], str, str | None, Calls]] = [
    (HermesToolParser, "plain text, no call", None, []),
    (
        HermesToolParser,
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n'
        '</tool_call>\n<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>',
        "I will check.\n\n",
        [("get_weather", {"city": "Paris", "n": [1, {"a": "}"}]}), ("add", {"x": 1})],
    ),
    (HermesToolParser, '<tool_call>{"name": "nope", "arguments": {}}</tool_call> after', None, []),  # unknown
    (HermesToolParser, '<tool_call>{"name": "add"}</tool_call>', "", [("add", {})]),
    (
        HermesToolParser,
        '<tool_call>{"name": "add", "arguments": {"s": "</tool_call>"}}</tool_call>',
        "",
        [("add", {"s": "</tool_call>"})],
    ),
    (HermesToolParser, '<tool_call>{"name": "add", "arguments": {}} and then', " and then", [("add", {})]),
    (HermesToolParser, '<tool_call>{"name": "add", "arguments": {}}, x</tool_call>', ", x</tool_call>", [("add", {})]),
    (HermesToolParser, "<tool_call>not json</tool_call>", None, []),
    (HermesToolParser, "a < b <tool_ca", None, []),
    (
        Llama3JSONToolParser,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}};'
        ' {"name": "add", "parameters": {"x": 1}}',
        "",
        [("get_weather", {"city": "Paris"}), ("add", {"x": 1})],
    ),
    (Llama3JSONToolParser, '\n{"name": "add", "arguments": {"s": "a;b}"}}', "", [("add", {"s": "a;b}"})]),
    (
        Llama3JSONToolParser,
        'Let me check.<|python_tag|>{"parameters": {}, "name": "get_weather"}',
        "Let me check.",
        [("get_weather", {})],
    ),
    (Llama3JSONToolParser, '{"name": "add", "parameters": {"x": 1}} and text', " and text", [("add", {"x": 1})]),
    (Llama3JSONToolParser, '{"name": "add", "parameters": {"x": 1}}; oops', "; oops", [("add", {"x": 1})]),
    (Llama3JSONToolParser, '{"answer": 42}', None, []),
    (Llama3JSONToolParser, '  {"name": "nope", "parameters": {}}', None, []),
    (Llama3JSONToolParser, "<|python_tag|>print(1)", None, []),  # the code interpreter
    (Llama3JSONToolParser, "I use <|python_ta", None, []),
    (
        MistralToolParser,
        '[TOOL_CALLS] [{"name": "add", "arguments": {"x": 1}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "",
        [("add", {"x": 1}), ("get_weather", {"city": "Oslo"})],
    ),
    (
        MistralToolParser,
        'Hello[TOOL_CALLS][{"name": "add", "arguments": {"x": 1}}] bye',
        "Hello bye",
        [("add", {"x": 1})],
    ),
    (
        MistralToolParser,
        '[TOOL_CALLS]add[ARGS]{"x": 1}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
        "",
        [("add", {"x": 1}), ("get_weather", {"city": "Oslo"})],
    ),
    (
        MistralToolParser,
        'Sure.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS] {"city": "[ARGS]"}',
        "Sure.",
        [("get_weather", {"city": "[ARGS]"})],
    ),
    (MistralToolParser, '[TOOL_CALLS]add{"x": 2}', "", [("add", {"x": 2})]),  # [ARGS] skipped as a special token
    (
        MistralToolParser,
        '[TOOL_CALLS][{"name": "add", "arguments": {"x": 1}}, {"name": "nope", "arguments": {}}]',
        ', {"name": "nope", "arguments": {}}]',
        [("add", {"x": 1})],
    ),
    (MistralToolParser, "[TOOL_CALLS]nope[ARGS]{}", None, []),
    (MistralToolParser, "[TOOL_CALLS]add[ARGS]not json", None, []),
    (MistralToolParser, "Use [TOOL_CALLS] wisely", None, []),
    (
        PythonicToolParser,
        "[get_weather(city='Paris', days=3), add(x=-1.5, y=True)]",
        "",
        [("get_weather", {"city": "Paris", "days": 3}), ("add", {"x": -1.5, "y": True})],
    ),
    (
        PythonicToolParser,
        "[add(x=None, y=[1, (2, 3)], z={'k': \"v)\"}, s='''it's \"here\"''', t='a\\'b',)]",
        "",
        [("add", {"x": None, "y": [1, [2, 3]], "z": {"k": "v)"}, "s": 'it\'s "here"', "t": "a'b"})],
    ),
    (PythonicToolParser, "<|python_start|>[add()]<|python_end|>", "", [("add", {})]),
    (
        PythonicToolParser,
        "Sure: <|python_start|>[get_weather(city='Oslo')]<|python_end|> done",
        "Sure:  done",
        [("get_weather", {"city": "Oslo"})],
    ),
    (PythonicToolParser, "[1] a footnote", None, []),
    (PythonicToolParser, "[add(x=1 + 2)]", None, []),  # not a literal
    (PythonicToolParser, "[add(1)]", None, []),  # not a keyword argument
    (PythonicToolParser, "[nope(x=1)]", None, []),
    (PythonicToolParser, "Say [add(x=1)]", None, []),  # not at the start
]
# Outputs cut short, or malformed, after a call's name: streamed, the call went out (it cannot be taken
# back) and its text is dropped; whole, it is content. (parser, output, streamed content, streamed calls)
BROKEN: list[tuple[type[ToolParser], str, str, list[tuple[str, str]]]] = [
    (HermesToolParser, '<tool_call>{"name": "add", "arguments": {"x"', "", [("add", '{"x"')]),
    (HermesToolParser, '<tool_call>{"name": "add", "arguments": {"x": 1} ?}</tool_call>!', "!", [("add", '{"x": 1}')]),
    (Llama3JSONToolParser, '{"name": "add", "parameters": {"x": 1', "", [("add", '{"x": 1')]),
    (
        Llama3JSONToolParser,
        '{"name": "add", "parameters": {"x": 1},} ok',
        " ok",
        [("add", '{"x": 1}')],
    ),  # a trailing comma
    (MistralToolParser, '[TOOL_CALLS]add[ARGS]{"x": tru}, more', ", more", [("add", '{"x": tru')]),
    (PythonicToolParser, "[add(x=1, y=f(2)), add(x=2)] after", " after", [("add", '{"x": 1'), ("add", '{"x": 2}')]),
    (PythonicToolParser, "[add(x=1, x=2)]", "", [("add", '{"x": 1')]),  # a repeated keyword
]


def read_stream(parser: ToolParser, pieces: Sequence[str]) -> tuple[str, list[tuple[str, str]]]:
    """The streamed content and calls (name, arguments text), checking how the deltas come:
    calls numbered in order, each one's name first and once."""
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        for c in d.calls:
            if c.name is not None:
                assert c.index == len(names)
                names[c.index] = c.name
            assert c.index in names
            args[c.index] = args.get(c.index, "") + c.arguments
    return "".join(d.content for d in deltas), [(names[i], args[i]) for i in range(len(names))]


def assert_streams_as_whole(parser_cls: type[ToolParser], text: str, pieces: Sequence[str]) -> None:
    whole = parser_cls(TOOLS).parse(text)
    content, calls = read_stream(parser_cls(TOOLS), pieces)
    assert content == whole.content, pieces
    assert [(n, json.loads(a)) for n, a in calls] == [(c.name, json.loads(c.arguments)) for c in whole.calls], pieces


def splits(text: str) -> list[list[str]]:
    """The text cut once at every position, and char by char."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def case_id(case: tuple) -> str:
    return f"{case[0].name}-{case[1][:24]}"


@pytest.mark.parametrize("parser_cls,text,content,calls", CASES, ids=map(case_id, CASES))
def test_whole(parser_cls, text, content, calls):
    out = parser_cls(TOOLS).parse(text)
    assert out.content == (text if content is None else content)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls


@pytest.mark.parametrize("parser_cls,text,content,calls", CASES, ids=map(case_id, CASES))
def test_streamed_cut_anywhere(parser_cls, text, content, calls):
    for pieces in splits(text):
        assert_streams_as_whole(parser_cls, text, pieces)


@pytest.mark.parametrize("parser_cls,text,content,calls", BROKEN, ids=map(case_id, BROKEN))
def test_broken_call_after_its_name(parser_cls, text, content, calls):
    assert parser_cls(TOOLS).parse(text).content == text
    assert read_stream(parser_cls(TOOLS), list(text)) == (content, calls)


# ---- random calls, written in each format ------------------------------------------------------
_FRAGMENTS = ['"', "'", "\\", "{", "}", "[", "]", "(", ")", ",", ";", "=", ":", " ", "\n", "é", "𝄞", "a", "0"]
_MARKERS = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "<|python_start|>"]
strings = st.lists(st.sampled_from(_FRAGMENTS + _MARKERS), max_size=8).map("".join)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
    max_leaves=8,
)
keywords = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
arguments = st.dictionaries(keywords, json_values, max_size=4)
calls_st = st.lists(st.tuples(st.sampled_from(["get_weather", "add"]), arguments), min_size=1, max_size=3)
spaces = st.sampled_from(["", " ", "\n", " \n "])
prose = st.text(st.sampled_from("ab ,.\n"), max_size=6)


def dump(value: Any, draw: Any) -> str:
    return json.dumps(
        value, ensure_ascii=draw(st.booleans()), separators=draw(st.sampled_from([(",", ":"), (", ", ": ")]))
    )


@st.composite
def outputs(draw: Any) -> tuple[type[ToolParser], str, str, Calls]:
    """(parser, an output with calls written as its model would, its content, the calls)."""
    calls = draw(calls_st)
    before, after = draw(prose), draw(prose)
    kind = draw(st.sampled_from(["hermes", "llama3_json", "mistral", "mistral_compact", "pythonic", "required"]))
    if kind == "hermes":
        body = "".join(
            f"<tool_call>{draw(spaces)}{dump({'name': n, 'arguments': a}, draw)}{draw(spaces)}</tool_call>"
            for n, a in calls
        )
        return HermesToolParser, before + body + after, before + after, calls
    if kind == "llama3_json":
        objects = f"{draw(spaces)};{draw(spaces)}".join(dump({"name": n, "parameters": a}, draw) for n, a in calls)
        tag = "<|python_tag|>" if before.strip() else draw(st.sampled_from(["<|python_tag|>", ""]))
        return Llama3JSONToolParser, before + tag + objects + after, (before if tag else "") + after, calls
    if kind == "mistral":
        items = f",{draw(spaces)}".join(dump({"name": n, "arguments": a}, draw) for n, a in calls)
        return MistralToolParser, f"{before}[TOOL_CALLS]{draw(spaces)}[{items}]{after}", before + after, calls
    if kind == "mistral_compact":
        body = "".join(f"[TOOL_CALLS]{n}[ARGS]{dump(a, draw)}" for n, a in calls)
        return MistralToolParser, before + body + after, before + after, calls
    if kind == "required":
        array = dump([{"name": n, "parameters": a} for n, a in calls], draw)
        return RequiredCalls, draw(spaces) + array + after, after, calls
    listed = ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls)
    if before.strip():
        return PythonicToolParser, f"{before}<|python_start|>[{listed}]<|python_end|>{after}", before + after, calls
    return PythonicToolParser, f"{before}[{listed}]{after}", after, calls


@settings(max_examples=150, deadline=None)
@given(outputs(), st.lists(st.integers(0, 10**6), max_size=8))
def test_random_calls(output, cuts):
    parser_cls, text, content, calls = output
    whole = parser_cls(TOOLS).parse(text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    at = sorted({c % (len(text) + 1) for c in cuts})
    assert_streams_as_whole(parser_cls, text, [text[i:j] for i, j in zip([0, *at], [*at, len(text)], strict=False)])


# ---- tool_choice required through the choice reader ---------------------------------------------------
REQUIRED = (
    ' [{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}},\n'
    '  {"name": "add", "parameters": {"x": 1, "y": true}}]'
)


def choice_stream(pieces: Sequence[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) of the OpenAI tool call deltas a required reader streams."""
    reader = required_reader()
    content, names, args = "", {}, {}
    for i, piece in enumerate(pieces):
        _, more, calls = reader.feed(piece, final=i == len(pieces) - 1)
        content += more
        for call in calls:
            if "id" in call:
                assert call["index"] == len(names) and call["id"].startswith("call_")
                names[call["index"]] = call["function"]["name"]
            args[call["index"]] = args.get(call["index"], "") + call["function"]["arguments"]
    return content, [(names[i], args[i]) for i in range(len(names))]


def required_reader() -> ChoiceReader:
    messages = [{"role": "user", "content": "hi"}]
    return ChoiceReader(ChatCompletionRequest(messages=messages, tools=TOOLS, tool_choice="required"), None, None)


def test_required_streams_each_call_as_it_is_written():
    _, content, calls = required_reader().read(REQUIRED)
    assert content is None
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert want == [("get_weather", {"city": "Paris", "days": 3}), ("add", {"x": 1, "y": True})]
    for pieces in splits(REQUIRED):
        streamed_content, streamed = choice_stream(pieces)
        assert streamed_content == "" and [(n, json.loads(a)) for n, a in streamed] == want
    # The first call is out, whole, once its object is written; the second's name once its string is.
    first = REQUIRED.index("}},") + 2
    assert [(n, json.loads(a)) for n, a in choice_stream([REQUIRED[:first], ""])[1]] == want[:1]
    reader = required_reader()
    reader.feed(REQUIRED[: REQUIRED.index('"add"') + 5], final=False)
    assert reader.called and set(reader.ids) == {0, 1}
    # Cut short by max_tokens: the complete calls are calls, the rest content.
    cut = REQUIRED[: REQUIRED.index('"y"')]
    _, content, calls = required_reader().read(cut)
    assert content == cut[first:] and len(calls) == 1


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


@pytest.mark.parametrize(
    "template,parser_cls",
    [
        (None, HermesToolParser),  # the default
        ("{% if tools %}<tool_call>{% endif %}", HermesToolParser),
        ("{{- '<|python_tag|>' + tool_call.name }}", Llama3JSONToolParser),
        (
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}',
            Llama3JSONToolParser,
        ),
        ("{{- '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}", MistralToolParser),
        ("put it in the format of [func_name1(params_name1=params_value1)] <|python_tag|>", PythonicToolParser),
        ("{{ messages }}", HermesToolParser),
    ],
)
def test_tool_parser_detected_from_the_template(template, parser_cls):
    assert PluginRegistry(load_entry_points=False).tool_parser(None, template) is parser_cls


def test_special_token_markers_are_decoded_unless_the_request_says():
    def request(**kw: Any) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, **kw)

    assert keeps_special_tokens(request(), MistralToolParser)
    assert keeps_special_tokens(request(tool_choice="auto"), MistralToolParser)
    assert not keeps_special_tokens(request(), HermesToolParser)
    assert not keeps_special_tokens(request(skip_special_tokens=True), MistralToolParser)
    assert not keeps_special_tokens(request(tool_choice="required"), MistralToolParser)
    assert not keeps_special_tokens(request(tool_choice="none"), MistralToolParser)


def test_tool_parsers_are_registered():
    registry = PluginRegistry(load_entry_points=False)
    for name in ("hermes", "llama3_json", "mistral", "pythonic"):
        assert registry.tool_parser(name).name == name
    with pytest.raises(Exception, match="unknown tool call parser 'nope'"):
        registry.tool_parser("nope")
