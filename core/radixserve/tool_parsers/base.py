"""Tool calling: the contract between the core and tool parsers.

A tool parser (registered through the ``register_tool_parsers`` hook, chosen
by ``--tool-call-parser`` or detected from the chat template) reads the tool
calls a model wrote in its own format out of its chat output, whole
(``parse``) or as it streams (``feed`` each new piece of text, ``finish`` at
the end). One parser instance serves one output. A call of a function not
among the request's tools, or one that is not well formed, stays content.

Streaming: ``content`` deltas concatenate to the non-streamed ``content``;
the first ``ToolCallDelta`` of call ``index`` carries its ``name``, and the
``arguments`` fragments of a call concatenate to a JSON text of its arguments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text


@dataclass
class ParsedOutput:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    name: str | None = None  # set on a call's first delta only
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class ToolParser(ABC):
    """Reads one output's tool calls. ``tools`` are the request's tools as
    OpenAI sends them (``{"type": "function", "function": {"name", "parameters", ...}}``)."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0  # detection tries the highest first
    # The format's markers are special tokens (Mistral's [TOOL_CALLS]): the outputs this parser
    # reads are decoded keeping special tokens, unless the request sets skip_special_tokens.
    special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]]):
        self.tools = tools
        self.names = {t["function"]["name"] for t in tools}

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """Whether a chat template's source shows this parser's format (for the default)."""
        return False

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The whole output's content and its complete tool calls, in order."""

    @abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """The next piece of streamed output; what can be told of it now."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The output ended: what ``feed`` still held back."""
