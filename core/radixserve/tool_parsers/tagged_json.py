"""Tool calls written as JSON objects between tags, ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` (Hermes, Qwen): the whole-output and the
streamed reading. Streamed, a call's name goes out once its string is complete
(``partial_json_parser`` reads the unfinished object), and its arguments as
the raw text the model wrote for them (an object or array: any prefix of it is
a prefix of the final JSON text), cut exactly where the value ends."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar, Optional

import partial_json_parser
from partial_json_parser.core.options import Allow

from radixserve.tool_parser import ParsedOutput, StreamDelta, ToolCall, ToolCallDelta, ToolParser

_DECODER = json.JSONDecoder()


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that could begin ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class TaggedJSONToolParser(ToolParser):
    start_tag: ClassVar[str]
    end_tag: ClassVar[str]
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")

    def __init__(self, tools: list[dict[str, Any]]):
        super().__init__(tools)
        self._args_key = re.compile(r'"(?:%s)"\s*:\s*' % "|".join(map(re.escape, self.argument_keys)))
        self.buffer = ""
        self.pos = 0  # buffer index up to which everything was told
        self.call_start: Optional[int] = None  # buffer index after the open call's start tag
        self.calls_sent = 0  # calls whose header went out
        self.header_sent = False
        self.args_sent = 0  # characters of the open call's arguments sent

    # ---- whole output ------------------------------------------------------------
    def _call(self, body: str) -> Optional[ToolCall]:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = next((obj[k] for k in self.argument_keys if k in obj), {})
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def parse(self, text: str) -> ParsedOutput:
        content, calls, pos = [], [], 0
        while True:
            i = text.find(self.start_tag, pos)
            if i < 0:
                break
            j = text.find(self.end_tag, i + len(self.start_tag))
            if j < 0:
                break
            call = self._call(text[i + len(self.start_tag) : j])
            if call is None:
                content.append(text[pos : j + len(self.end_tag)])
            else:
                content.append(text[pos:i])
                calls.append(call)
            pos = j + len(self.end_tag)
        content.append(text[pos:])
        return ParsedOutput("".join(content), calls)

    # ---- streamed ----------------------------------------------------------------
    def feed(self, text: str) -> StreamDelta:
        self.buffer += text
        out = StreamDelta()
        while True:
            if self.call_start is None:
                i = self.buffer.find(self.start_tag, self.pos)
                if i < 0:
                    safe = len(self.buffer) - held_prefix(self.buffer[self.pos :], self.start_tag)
                    out.content += self.buffer[self.pos : safe]
                    self.pos = safe
                    return out
                out.content += self.buffer[self.pos : i]
                self.pos = self.call_start = i + len(self.start_tag)
                self.header_sent, self.args_sent = False, 0
            j = self.buffer.find(self.end_tag, self.call_start)
            body = self.buffer[self.call_start : j if j >= 0 else len(self.buffer)]
            if j < 0:
                self._stream_call(body, out)
                return out
            call = self._call(body)
            if call is None:
                if not self.header_sent:  # not a call after all: content, as parse() has it
                    out.content += self.start_tag + body + self.end_tag
            else:
                self._stream_call(body, out, complete=call)
            if self.header_sent:
                self.calls_sent += 1
            self.pos = j + len(self.end_tag)
            self.call_start = None

    def _stream_call(self, body: str, out: StreamDelta, complete: Optional[ToolCall] = None) -> None:
        index = self.calls_sent
        if not self.header_sent:
            name = complete.name if complete else self._partial_name(body)
            if name is None:
                return
            out.calls.append(ToolCallDelta(index, name=name))
            self.header_sent = True
        match = self._args_key.search(body)
        fragment = ""
        if match is None:
            if complete is not None and self.args_sent == 0:
                fragment = complete.arguments  # no arguments written: {}
        else:
            start = match.end()
            try:
                _, end = _DECODER.raw_decode(body, start)
                value = body[start:end]
            except ValueError:
                value = body[start:] if body[start : start + 1] in ("{", "[") else ""
                if complete is not None:
                    value = complete.arguments
            fragment = value[self.args_sent :]
        if fragment:
            self.args_sent += len(fragment)
            if out.calls and out.calls[-1].index == index and not out.calls[-1].arguments:
                head = out.calls.pop()
                out.calls.append(ToolCallDelta(index, name=head.name, arguments=fragment))
            else:
                out.calls.append(ToolCallDelta(index, arguments=fragment))

    def _partial_name(self, body: str) -> Optional[str]:
        text = body.strip()
        if not text.startswith("{"):
            return None
        try:
            obj = partial_json_parser.loads(text, Allow.ALL & ~Allow.STR)
        except Exception:
            return None
        name = obj.get("name") if isinstance(obj, dict) else None
        return name if isinstance(name, str) and name in self.names else None

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self.call_start is None:
            out.content = self.buffer[self.pos :]
        elif not self.header_sent:  # an unfinished call: content, as parse() has it
            out.content = self.start_tag + self.buffer[self.call_start :]
        self.pos = len(self.buffer)
        return out


class HermesToolParser(TaggedJSONToolParser):
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``."""

    name = "hermes"
    priority = 10
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    @classmethod
    def matches_template(cls, template: str) -> bool:
        return "<tool_call>" in template
