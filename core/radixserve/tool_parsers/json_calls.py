"""Calls written as JSON objects, ``{"name": ..., "arguments": {...}}``, read
as their text arrives, each character once.

A value's extent is found by its brackets and strings alone (``ValueExtent``),
so an unfinished value is told from a malformed one: a value whose extent
ended is complete, and ``json.loads`` then says whether it is well formed. A
call's name goes out once its string is complete; its arguments as the raw
text the model wrote for them, any prefix of which is a prefix of the final
JSON text, cut exactly where the value ends.
"""

from __future__ import annotations

import json
import re

from radixserve.tool_parsers.forms import CallReader, FormToolParser, Reading, run_end, skip_ws

_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*', re.DOTALL)  # up to a closing quote (or a final lone backslash)
_OUTSIDE_STRINGS = re.compile(r'[^"{}\[\]]*')
_SCALAR = re.compile(r"[-+.\w]*")  # a number, true, false or null
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


class ValueExtent:
    """Where the JSON value at ``start`` ends, found as the text arrives."""

    def __init__(self, start: int):
        self.start = start
        self.end: int | None = None
        self.pos = start  # where reading goes on
        self.depth = 0
        self.in_string = False

    def read(self, text: str) -> int | None:
        """The value's end (exclusive) once the text holds all of it."""
        if self.end is not None or self.pos >= len(text):
            return self.end
        if self.pos == self.start and text[self.start] not in '{["':
            scalar = run_end(_SCALAR, text, self.start)
            if scalar < len(text):  # at the end of the text a number may still go on
                self.end = scalar
            return self.end
        i = self.pos
        while i < len(text):
            if self.in_string:
                i = run_end(_STRING_BODY, text, i)
                if i == len(text) or text[i] != '"':
                    break
                i += 1
                self.in_string = False
                if self.depth == 0:  # the value is a string
                    self.end = i
                    break
                continue
            i = run_end(_OUTSIDE_STRINGS, text, i)
            if i == len(text):
                break
            c = text[i]
            i += 1
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.end = i
                    break
        self.pos = i
        return self.end


class ObjectMembers:
    """The top-level members of the JSON object at ``start`` (a ``{``), read as
    the text arrives: ``members`` maps each key (its first occurrence) to its
    value's extent, ``end`` is the object's end once closed, ``error`` where the
    text stopped being a JSON object."""

    def __init__(self, start: int):
        self.members: dict[str, ValueExtent] = {}
        self.end: int | None = None
        self.error: int | None = None
        self.pos = start + 1
        self.state = "key"  # then "colon", "value", "next" (a comma or the closing brace)
        self.key = ""
        self.value: ValueExtent | None = None

    def read(self, text: str) -> None:
        while self.end is None and self.error is None:
            if self.value is not None:
                end = self.value.read(text)
                if end is None:
                    return
                self.pos, self.value, self.state = end, None, "next"
            i = skip_ws(text, self.pos)
            if i == len(text):
                return
            c = text[i]
            if self.state == "key" and c == '"':
                string = _STRING.match(text, i)
                if string is None:
                    return
                try:
                    self.key = json.loads(string.group())
                except ValueError:
                    self.error = i
                    return
                self.pos, self.state = string.end(), "colon"
            elif self.state == "colon" and c == ":":
                self.pos, self.state = i + 1, "value"
            elif self.state == "value":
                self.value = ValueExtent(i)
                self.members.setdefault(self.key, self.value)
            elif self.state == "next" and c == ",":
                self.pos, self.state = i + 1, "key"
            elif self.state in ("key", "next") and c == "}":  # json.loads checks there was no trailing comma
                self.end = i + 1
            else:
                self.error = i


class JSONCallReader(CallReader):
    """A call written as a JSON object: its ``name`` and arguments (the value of
    its first member keyed by one of the parser's ``argument_keys``; none: ``{}``)."""

    def __init__(self, parser: FormToolParser, start: int):
        super().__init__(parser, start)
        self.argument_keys = parser.argument_keys
        self.object = ObjectMembers(start)
        self.brackets = ValueExtent(start)  # read only if the object turns out malformed

    def read(self, text: str) -> Reading:
        if self.start >= len(text):
            return Reading()
        if text[self.start] != "{":
            return Reading(ok=False)
        obj = self.object
        obj.read(text)
        name: str | None = None
        extent = obj.members.get("name")
        if extent is not None and extent.end is not None:
            try:
                value = json.loads(text[extent.start : extent.end])
            except ValueError:
                value = None
            if not (isinstance(value, str) and value in self.names):
                return Reading(ok=False, end=obj.end)
            name = value
        args = next((v for k, v in obj.members.items() if k in self.argument_keys), None)
        arguments = "" if args is None else text[args.start : args.end or len(text)]
        if obj.error is not None:
            if name is None:
                return Reading(ok=False, end=obj.error)
            # Its name went out: read on to where its brackets close, so that all of it is dropped.
            end = self.brackets.read(text)
            return Reading(ok=None if end is None else False, end=end, name=name, arguments=arguments)
        if obj.end is None:
            return Reading(name=name, arguments=arguments)
        try:
            whole = json.loads(text[self.start : obj.end])
        except ValueError:
            whole = None
        if name is None or not isinstance(whole, dict):
            return Reading(ok=False, end=obj.end)
        return Reading(ok=True, end=obj.end, name=name, arguments=arguments or "{}")
