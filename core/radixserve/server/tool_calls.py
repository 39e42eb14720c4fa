"""Tool calling at the API edge: the request's tools checked, ``tool_choice``
required / named turned into a grammar, and each choice's output read back
into ``tool_calls`` (whole or streamed), after the reasoning split.

- ``auto``: the tool parser (``--tool-call-parser``) reads what the model wrote.
- ``required``: the output is constrained to a JSON array of
  ``{"name": <an allowed function>, "parameters": <valid arguments>}`` (one item
  when ``parallel_tool_calls`` is false), the form vLLM uses; it is the same
  whatever the parser, and any grammar backend compiles it. ``RequiredCalls``
  reads it back like a tool parser, so streamed, each call goes out as it is
  written (its name, then its parameters as they grow).
- named: the output is constrained to the function's arguments (its
  ``parameters`` schema) and becomes that one call.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import jsonschema

from radixserve.reasoning_parsers.base import ReasoningParser
from radixserve.server.errors import APIError
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.structured_output.backend import GrammarSpec
from radixserve.tool_parsers.base import ParsedOutput, StreamDelta, ToolCall, ToolCallDelta, ToolParser
from radixserve.tool_parsers.forms import CallForm, FormToolParser
from radixserve.tool_parsers.json_calls import JSONCallReader

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in req.tools or []]


def check_tools(req: ChatCompletionRequest) -> None:
    """400s naming the field: an invalid parameters schema, a tool_choice naming no tool."""
    for i, tool in enumerate(req.tools or []):
        params = tool.function.parameters
        if params is not None:
            try:
                jsonschema.validators.validator_for(params).check_schema(params)
            except jsonschema.SchemaError as exc:
                raise APIError(
                    400,
                    f"tools[{i}].function.parameters: not a valid JSON schema: {exc.message}",
                    param=f"tools[{i}].function.parameters",
                ) from exc
    name = req.named_tool
    if name is not None and name not in {t.function.name for t in req.tools or []}:
        raise APIError(400, f"tool_choice: names the function {name!r}, which is not among the tools", "tool_choice")


def tool_grammar(req: ChatCompletionRequest) -> GrammarSpec | None:
    """The grammar of tool_choice required or named; None otherwise."""
    tools = {t.function.name: t.function.parameters or ANY_OBJECT for t in req.tools or []}
    name = req.named_tool
    if name is not None:
        return GrammarSpec("json_schema", json.dumps(tools[name]), "tool_choice")
    if req.tool_choice != "required":
        return None
    item = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for n, schema in tools.items()
        ]
    }
    array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if req.parallel_tool_calls is False:
        array["maxItems"] = 1
    return GrammarSpec("json_schema", json.dumps(array), "tool_choice")


def keeps_special_tokens(req: ChatCompletionRequest, parser_cls: type[ToolParser] | None) -> bool:
    """Whether the output must be decoded keeping special tokens for the tool parser to
    read it: tool_choice auto, a parser whose markers are special tokens, and a request
    that left skip_special_tokens unset."""
    auto = bool(req.tools) and req.tool_choice in (None, "auto")
    return auto and getattr(parser_cls, "special_tokens", False) and "skip_special_tokens" not in req.model_fields_set


class RequiredCalls(FormToolParser):
    """The JSON array that ``tool_grammar`` makes tool_choice required write."""

    name = "required"
    argument_keys = ("parameters",)
    forms = (CallForm(JSONCallReader, ("[",), at_start=True, separator=",", closing=("]",)),)


def tool_call_json(index: int | None, call_id_: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    """A tool call (or a streamed piece of one) as OpenAI writes it."""
    out: dict[str, Any] = {}
    if index is not None:
        out["index"] = index
    if call_id_ is not None:
        out["id"] = call_id_
        out["type"] = "function"
    out["function"] = {"arguments": arguments} if name is None else {"name": name, "arguments": arguments}
    return out


class ChoiceReader:
    """One choice's output read back: reasoning split off, then tool calls."""

    def __init__(
        self, req: ChatCompletionRequest, parser_cls: type[ToolParser] | None, reasoning: type[ReasoningParser] | None
    ) -> None:
        self.reasoning = reasoning() if reasoning is not None else None
        self.named = req.named_tool if req.tools else None
        self.parser: ToolParser | None = None
        if req.tools and req.tool_choice == "required":
            self.parser = RequiredCalls(tool_dicts(req))
        elif req.tools and req.tool_choice in (None, "auto") and parser_cls is not None:
            self.parser = parser_cls(tool_dicts(req))
        self.named_started = False
        self.ids: dict[int, str] = {}
        self.called = False

    # ---- whole output -----------------------------------------------------------------
    def read(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """``(reasoning_content, content, tool_calls)``."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse(text)
        parsed = self._calls(text)
        calls = [tool_call_json(None, call_id(), c.name, c.arguments) for c in parsed.calls]
        self.called = bool(calls)
        content: str | None = parsed.content
        if calls and not (content or "").strip():
            content = None
        return reasoning, content, calls

    def _calls(self, text: str) -> ParsedOutput:
        if self.named is not None:
            try:
                json.loads(text)
            except ValueError:
                return ParsedOutput(text)  # cut short (length): not a call
            return ParsedOutput("", [ToolCall(self.named, text)])
        if self.parser is not None:
            return self.parser.parse(text)
        return ParsedOutput(text)

    # ---- streamed -------------------------------------------------------------------------
    def feed(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """``(reasoning delta, content delta, tool call deltas)`` for the next piece of output."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more_r, more_c = self.reasoning.finish()
                reasoning, content = reasoning + more_r, content + more_c
        delta = self._feed_calls(content, final)
        calls = []
        for d in delta.calls:
            if d.name is not None:
                self.ids[d.index] = call_id()
                calls.append(tool_call_json(d.index, self.ids[d.index], d.name, d.arguments))
            else:
                calls.append(tool_call_json(d.index, None, None, d.arguments))
        self.called = self.called or bool(calls)
        return reasoning, delta.content, calls

    def _feed_calls(self, text: str, final: bool) -> StreamDelta:
        if self.named is not None:
            out = StreamDelta()
            if text:
                out.calls.append(ToolCallDelta(0, name=None if self.named_started else self.named, arguments=text))
                self.named_started = True
            return out
        if self.parser is not None:
            out = self.parser.feed(text)
            if final:
                rest = self.parser.finish()
                out = StreamDelta(out.content + rest.content, out.calls + rest.calls)
            return out
        return StreamDelta(text)
