"""Pythonic tool calls (Llama 3.2 and Llama 4 with a pythonic template,
ToolACE): a Python list of calls with keyword arguments,
``[get_weather(city="Paris", days=3), add(x=1, y=True)]``, at the very start
of the output or after ``<|python_start|>`` (then closed by ``<|python_end|>``).

The values must be literals (strings, numbers, booleans, ``None``, and lists,
tuples and dicts of them): each is parsed with ``ast``, never evaluated, and
goes out as JSON. Streamed, a call goes out with its first argument (so that
a call whose first value is no literal, the likeliest slip, stays content),
then one argument at a time, as each value completes."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from radixserve.tool_parsers.forms import CallForm, CallReader, FormToolParser, Reading, run_end, skip_ws

_IDENTIFIER = re.compile(r"[^\W\d]\w*")
_OUTSIDE_STRINGS = re.compile(r"[^'\"()\[\]{},]*")
# A string's body up to its closing quote, or to where the text may yet close it: a backslash
# escapes the next character, and in a triple-quoted string a quote goes only when no closing follows.
_STRING_BODIES = {
    "'": re.compile(r"(?:[^'\\]|\\.)*", re.DOTALL),
    '"': re.compile(r'(?:[^"\\]|\\.)*', re.DOTALL),
    "'''": re.compile(r"(?:[^'\\]|\\.|'(?=[^']|'[^']))*", re.DOTALL),
    '"""': re.compile(r'(?:[^"\\]|\\.|"(?=[^"]|"[^"]))*', re.DOTALL),
}


def literal(node: ast.expr) -> Any:
    """The JSON value of a Python literal; ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
    ):
        number = node.operand.value
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [None if k is None else literal(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict's keys must be strings")
        return dict(zip(keys, map(literal, node.values), strict=True))
    raise ValueError(f"not a literal: {ast.dump(node)}")


class ValueExtent:
    """Where the Python value at ``start`` ends: before the first ``,`` or
    closing bracket outside brackets and strings, found as the text arrives."""

    def __init__(self, start: int):
        self.start = start
        self.end: int | None = None
        self.pos = start  # where reading goes on
        self.depth = 0
        self.quote = ""  # of the string being read

    def read(self, text: str) -> int | None:
        i = self.pos
        while self.end is None:
            if self.quote:
                i = run_end(_STRING_BODIES[self.quote], text, i)
                if not text.startswith(self.quote, i):  # the text ends inside the string
                    break
                i, self.quote = i + len(self.quote), ""
                continue
            i = run_end(_OUTSIDE_STRINGS, text, i)
            if i == len(text):
                break
            c = text[i]
            if c in "'\"":
                if len(text) - i <= 2 and text.endswith(c * (len(text) - i)):  # "" or the start of """?
                    break
                self.quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(self.quote)
            elif c in ",)]}" and self.depth == 0:
                self.end = i
            else:
                if c in "([{":
                    self.depth += 1
                elif c != ",":
                    self.depth -= 1
                i += 1
        self.pos = i
        return self.end


class PythonCallReader(CallReader):
    """``name(key=value, ...)``: the arguments as a JSON object, one member as
    each value completes."""

    def __init__(self, parser: FormToolParser, start: int):
        super().__init__(parser, start)
        self.pos = start
        self.state = "function"  # then "open", "key", "equals", "value", "next" (a comma or the closing parenthesis)
        self.name = ""
        self.key = ""
        self.members: dict[str, str] = {}  # key: the value's JSON text
        self.value: ValueExtent | None = None
        self.broken = False  # not a call after all, read on to its end

    def so_far(self, ok: bool | None = None, end: int | None = None) -> Reading:
        if not (self.members or ok):
            return Reading(ok, end)
        members = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in self.members.items())
        return Reading(ok, end, self.name, "{" + members + ("}" if ok else ""))

    def read(self, text: str) -> Reading:
        while True:
            if self.value is not None:
                end = self.value.read(text)
                if end is None:
                    return self.so_far()
                start, self.value = self.value.start, None
                if self.broken:
                    if text[end] == ",":
                        self.value = ValueExtent(end + 1)
                        continue
                    return Reading(ok=False, end=end + 1 if text[end] == ")" else end)
                try:
                    value = literal(ast.parse(text[start:end].strip(), mode="eval").body)
                    self.members[self.key] = json.dumps(value, ensure_ascii=False, allow_nan=False)
                except (SyntaxError, ValueError, RecursionError):
                    if not self.members:
                        return Reading(ok=False, end=end)
                    self.broken, self.value = True, ValueExtent(end)
                    continue
                self.pos, self.state = end, "next"
            i = skip_ws(text, self.pos)
            if i == len(text):
                return self.so_far()
            c = text[i]
            word = _IDENTIFIER.match(text, i)
            if self.state in ("function", "key") and word is not None and word.end() == len(text):  # it may go on
                if self.state == "key" or any(n.startswith(word.group()) for n in self.names):
                    return self.so_far()
                return Reading(ok=False)
            if self.state == "function" and word is not None and word.group() in self.names:
                self.pos, self.state, self.name = word.end(), "open", word.group()
            elif self.state == "open" and c == "(":
                self.pos, self.state = i + 1, "key"
            elif self.state == "key" and word is not None and word.group() not in self.members:
                self.pos, self.state, self.key = word.end(), "equals", word.group()
            elif self.state == "equals" and c == "=":
                self.pos, self.state = i + 1, "value"
            elif self.state == "value":
                self.value = ValueExtent(i)
            elif self.state == "next" and c == ",":
                self.pos, self.state = i + 1, "key"
            elif self.state in ("key", "next") and c == ")":
                return self.so_far(ok=True, end=i + 1)
            elif not self.members:
                return Reading(ok=False, end=i)
            else:  # it went out: read on to its closing parenthesis, so that all of it is dropped
                self.broken, self.value = True, ValueExtent(i)


class PythonicToolParser(FormToolParser):
    name = "pythonic"
    priority = 20  # before llama3_json: a pythonic Llama template may show Llama's tags too
    forms = (
        CallForm(PythonCallReader, ("[",), at_start=True, separator=",", closing=("]",)),
        CallForm(PythonCallReader, ("<|python_start|>", "["), separator=",", closing=("]", "<|python_end|>")),
    )

    @classmethod
    def matches_template(cls, template: str) -> bool:
        # The format the pythonic templates (vLLM's examples, ToolACE's) spell out.
        return "[func_name1(" in template
