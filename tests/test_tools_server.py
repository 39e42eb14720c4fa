"""Tool calling and reasoning through real servers and the official openai
client. The tiny model babbles, so required and named tool_choice must hold by
the grammar: every call names an allowed function and its arguments validate.
Servers at --stream-interval 1 (the session's plain tiny_server) and 4 (the
module's, with --reasoning-parser qwen3)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from helpers_server import PRIORITY_BACKENDS, ServerProcess, serving

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "boolean"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "adds", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module", params=[1, 4])
def server(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    """--stream-interval 1 is the default: the session's plain tiny_server."""
    if request.param == 1:
        yield request.getfixturevalue("tiny_server")
        return
    flags = ["--stream-interval", "4", "--reasoning-parser", "qwen3", "--max-total-tokens", "65536"]
    with serving(tiny_llama_dir, *flags, *PRIORITY_BACKENDS) as srv:
        yield srv


def _reasons(srv: ServerProcess) -> bool:
    """Whether ``srv`` splits out reasoning (the qwen3 server)."""
    return "--reasoning-parser" in srv.proc.args


def _client(srv: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)


async def _calls(client: openai.AsyncOpenAI, stream: bool, **kw: Any) -> tuple[list[tuple[str, str]], str]:
    """([(name, arguments)], finish_reason), streamed or not."""
    args = {"model": "tiny", "messages": MESSAGES, "temperature": 1.0, "max_tokens": 300, "tools": TOOLS, **kw}
    if not stream:
        out = await client.chat.completions.create(**args)
        calls = out.choices[0].message.tool_calls or []
        assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
        return [(c.function.name, c.function.arguments) for c in calls], out.choices[0].finish_reason
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    reason = None
    async for chunk in await client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in names and call.type == "function" and call.id.startswith("call_")
                    assert call.index > 0 or not choice.finish_reason  # streamed as written, not held to the end
                    names[call.index] = call.function.name
                assert call.index in names
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    return [(names[i], arguments[i]) for i in sorted(names)], reason


def test_required_and_named_always_give_valid_calls(server: ServerProcess, tiny_tokenizer: Any) -> None:
    # Parallel calls are an unbounded array: a bias towards "]" lets the babbling model close it.
    close = {str(t): 10 for t in tiny_tokenizer.encode("]", add_special_tokens=False)}
    # On the qwen3 server the grammar waits for any reasoning, which this model never ends: no "<think>".
    no_think = {str(tiny_tokenizer.encode("<think>", add_special_tokens=False)[0]): -100} if _reasons(server) else {}
    close.update(no_think)

    async def run() -> list[tuple[Any, list[tuple[str, str]], str]]:
        async with _client(server) as client:
            jobs = []
            for seed in range(20):
                stream = seed % 2 == 1
                jobs.append(("required", _calls(client, stream, seed=seed, tool_choice="required", logit_bias=close)))
                named = {"type": "function", "function": {"name": "add"}}
                jobs.append(("add", _calls(client, stream, seed=seed, tool_choice=named, logit_bias=no_think)))
                one = {"tool_choice": "required", "parallel_tool_calls": False, "logit_bias": no_think}
                jobs.append(("one", _calls(client, stream, seed=seed, **one)))
            outs = await asyncio.gather(*(job for _, job in jobs))
            return [(want, calls, reason) for (want, _), (calls, reason) in zip(jobs, outs, strict=False)]

    for want, calls, reason in asyncio.run(run()):
        assert reason == "tool_calls" and calls, (want, calls)
        if want != "required":
            assert len(calls) == 1
        for name, arguments in calls:
            assert name in SCHEMAS and (want != "add" or name == "add")
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_leaves_plain_text_as_content(server: ServerProcess) -> None:
    async def run() -> list[Any]:
        async with _client(server) as client:
            return await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=30, seed=seed, temperature=1.0
                    )
                    for seed in range(4)
                )
            )

    for out in asyncio.run(run()):
        message = out.choices[0].message
        assert message.tool_calls is None and message.content and out.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_tool_errors_are_400s_naming_the_field(server: ServerProcess, body: dict, param: str) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    args = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **body}
    args = {k: v for k, v in args.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**args)
    assert err.value.body["param"] == param, err.value.body


def test_reasoning_then_grammar(server: ServerProcess, tiny_tokenizer: Any) -> None:
    """qwen3: the grammar waits for the reasoning. <think> and </think> are single tokens of the tiny
    tokenizer (as in Qwen3). Forbidding <think> keeps the output out of reasoning (valid JSON content);
    forcing it opens the reasoning, which then runs free to max_tokens (never valid JSON) and is
    reasoning_content; favouring </think> over <think> opens and closes it, then the grammar
    gives valid JSON content."""
    if not _reasons(server):
        pytest.skip("the reasoning server only")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    start, end = (tiny_tokenizer.convert_tokens_to_ids(tag) for tag in ("<think>", "</think>"))
    assert tiny_tokenizer.encode("<think></think>", add_special_tokens=False) == [start, end]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    cases = (({start: -100}, "none"), ({start: 100}, "open"), ({start: 50, end: 100}, "closed"))
    for stream in (False, True):
        for bias, reasoned in cases:
            args = dict(model="tiny", messages=MESSAGES, max_tokens=40, seed=1, response_format=fmt)
            args["logit_bias"] = {str(t): b for t, b in bias.items()}
            if stream:
                reasoning, content = "", ""
                for chunk in client.chat.completions.create(stream=True, **args):
                    for c in chunk.choices:
                        reasoning += getattr(c.delta, "reasoning_content", None) or ""
                        content += c.delta.content or ""
            else:
                message = client.chat.completions.create(**args).choices[0].message
                reasoning, content = getattr(message, "reasoning_content", None) or "", message.content or ""
            if reasoned == "open":
                assert reasoning and not content
            else:
                assert not reasoning, (stream, reasoned, reasoning)
                jsonschema.validate(json.loads(content), schema)
