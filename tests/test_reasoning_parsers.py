"""Reasoning parsers, a plugin kind: the built-ins' split (whole, and streamed cut
anywhere: the pieces add up to the whole), their registration, and a third-party
parser registered through the hook: found by the registry, listed by
`radixserve plugins`, and used end to end by a server (the split and the grammar's
reasoning gate). An unknown --reasoning-parser is a start-up error (test_cli_startup.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from helpers_server import PRIORITY_BACKENDS, ServerProcess, serving
from test_plugins import make_dist, plugins_json_with

from radixserve.hooks import Register, hookimpl
from radixserve.reasoning_parsers.base import ReasoningParser
from radixserve.reasoning_parsers.builtin import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from radixserve.registry import BUILTIN_REASONING_PLUGIN, PluginError, PluginRegistry
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.tool_calls import ChoiceReader

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


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_reasoning_split(name: str, text: str, reasoning: str | None, content: str, size: int) -> None:
    cls = PluginRegistry(load_entry_points=False).reasoning_parser(name)
    assert cls().parse(text) == (reasoning, content)
    parser = cls()
    pieces = [parser.feed(p) for p in chunks(text, size)] + [parser.finish()]
    assert "".join(r for r, _ in pieces) == (reasoning or "")
    assert "".join(c for _, c in pieces) == content


def test_builtin_reasoning_parsers_are_registered_through_the_hook() -> None:
    registry = PluginRegistry(load_entry_points=False)
    assert registry.reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert registry.reasoning_parser("deepseek-r1") is DeepSeekR1ReasoningParser
    assert registry.plugins[BUILTIN_REASONING_PLUGIN].registered == {"reasoning": ["qwen3", "deepseek-r1"]}
    with pytest.raises(PluginError, match=r"--reasoning-parser 'nope' is not a registered .*deepseek-r1, qwen3"):
        registry.reasoning_parser("nope")
    rows = registry.report()["backends"]["reasoning"]
    assert {"name": "qwen3", "plugin": BUILTIN_REASONING_PLUGIN, "start": "<think>", "end": "</think>"}.items() <= (
        rows[1].items()
    )
    assert [(r["name"], r["starts_in_reasoning"]) for r in rows] == [("deepseek-r1", True), ("qwen3", False)]


class Bracketed(ReasoningParser):
    """A third party's format: reasoning in [[ ]], from the output's first character."""

    name = "bracketed"
    start, end = "[[", "]]"
    starts_in_reasoning = True


def test_a_third_party_parser_registered_in_process_is_found_and_read_by_the_server() -> None:
    class Plugin:
        @hookimpl
        def register_reasoning_parsers(self, register: Register) -> None:
            register(Bracketed)

    registry = PluginRegistry(load_entry_points=False)
    registry.register_plugin(Plugin(), "bracketed-plugin")
    cls = registry.reasoning_parser("bracketed")
    assert cls is Bracketed
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert ChoiceReader(request, None, cls).read("[[plan]]answer") == ("plan", "answer", [])
    reader = ChoiceReader(request, None, cls)
    pieces = [reader.feed(p, final=False) for p in ("pl", "an]", "]ans")] + [reader.feed("wer", final=True)]
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == ("plan", "answer")


# ---- a third party's parser, installed (dist-info and entry point), served -----------------------

PLUGIN_SOURCE = """
    from radixserve.hooks import hookimpl
    from radixserve.reasoning_parsers.base import ReasoningParser


    class AlwaysThinks(ReasoningParser):
        # The prompt opened the reasoning: the output is reasoning up to </think>.
        name = "always-thinks"
        start, end = "<think>", "</think>"
        starts_in_reasoning = True


    @hookimpl
    def register_reasoning_parsers(register):
        register(AlwaysThinks)
"""


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reasoning_plugin")
    make_dist(path, "radixserve-plugin-thinks", "thinks", "thinks_plugin", PLUGIN_SOURCE)
    return path


def test_a_third_party_parser_is_listed_by_radixserve_plugins(plugin_path: Path) -> None:
    report = plugins_json_with(plugin_path)
    plugin = next(p for p in report["plugins"] if p["name"] == "thinks")
    assert plugin["error"] is None and plugin["hooks"] == ["register_reasoning_parsers"]
    assert plugin["registered"] == {"reasoning": ["always-thinks"]}
    row = next(r for r in report["backends"]["reasoning"] if r["name"] == "always-thinks")
    assert row == {
        "name": "always-thinks",
        "plugin": "thinks",
        "start": "<think>",
        "end": "</think>",
        "starts_in_reasoning": True,
    }


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, plugin_path: Path) -> Iterator[ServerProcess]:
    env = {"PYTHONPATH": f"{plugin_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with serving(
        tiny_llama_dir, "--reasoning-parser", "always-thinks", "--max-total-tokens", "8192", *PRIORITY_BACKENDS, env=env
    ) as srv:
        yield srv


def _chat(server: ServerProcess, stream: bool, **kw: Any) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of one chat completion; streamed, each is None when no delta had it."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    args = {"model": "tiny", "messages": [{"role": "user", "content": "Answer."}], "seed": 1, **kw}
    if not stream:
        message = client.chat.completions.create(**args).choices[0].message
        return getattr(message, "reasoning_content", None), message.content
    reasoning: str | None = None
    content: str | None = None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            if getattr(c.delta, "reasoning_content", None) is not None:
                reasoning = (reasoning or "") + c.delta.reasoning_content
            if c.delta.content is not None:
                content = (content or "") + c.delta.content
    return reasoning, content


@pytest.mark.parametrize("stream", [False, True])
def test_a_third_party_parser_is_used_end_to_end(server: ServerProcess, tiny_tokenizer: Any, stream: bool) -> None:
    """always-thinks starts in reasoning (qwen3 would not): with </think> forbidden the whole output is
    reasoning. With a grammar and </think> favoured, the gate (starting in reasoning, as the plugin says)
    lets </think> through first, then the grammar: the content is valid JSON, the reasoning empty."""
    start, end = (tiny_tokenizer.convert_tokens_to_ids(tag) for tag in ("<think>", "</think>"))
    reasoning, content = _chat(server, stream, max_tokens=12, logit_bias={str(start): -100, str(end): -100})
    assert reasoning and not content, (reasoning, content)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    reasoning, content = _chat(
        server, stream, max_tokens=40, response_format=fmt, logit_bias={str(start): -100, str(end): 100}
    )
    assert not reasoning, reasoning
    jsonschema.validate(json.loads(content or ""), schema)
