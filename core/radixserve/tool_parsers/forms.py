"""The reading the built-in tool parsers share: a parser declares the forms
its model writes calls in, and ``FormToolParser`` reads them, whole or
streamed, with one state machine (so the two readings agree by construction).

A form is a run of calls: ``opening`` tokens (the first a marker found
anywhere in the output, or, for an ``at_start`` form, found only at the
output's start), then calls, each read by the form's ``CallReader``, between
them the ``separator`` (none: one call a run), then the ``closing`` tokens,
each optional. Whitespace may come before every token and call.

What is not a call is content, byte for byte: a run whose first call is not a
call (an unknown function, malformed, or unfinished when the output ends)
is content from its marker on, and a later call that is not one ends the run
before its separator. Streamed, a call's name goes out once its reader knows
it (a known function) and its arguments' JSON text as it grows; text that may
still become a call is held back. A call whose name went out cannot be taken
back: if it then turns out malformed or unfinished, its text is dropped
(whole, it is content).

``parse`` is the stream read at once, with the end known, so it only decides
on complete calls.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from radixserve.tool_parsers.base import ParsedOutput, StreamDelta, ToolCall, ToolCallDelta, ToolParser

WHITESPACE = " \t\r\n"


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def run_end(pattern: re.Pattern[str], text: str, pos: int) -> int:
    """Where ``pattern``, one that matches the empty string, stops matching from ``pos``."""
    found = pattern.match(text, pos)
    assert found is not None
    return found.end()


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that could begin ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def match(text: str, pos: int, token: str) -> tuple[bool | None, int]:
    """``token`` at ``pos`` after optional whitespace: ``(True, its end)``,
    ``(None, pos)`` while the text ends before telling, ``(False, pos)``."""
    at = skip_ws(text, pos)
    got = text[at : at + len(token)]
    if got == token:
        return True, at + len(token)
    return (None if len(got) < len(token) and token.startswith(got) else False), pos


@dataclass(frozen=True)
class Reading:
    """What a ``CallReader`` can tell of its call so far."""

    ok: bool | None = None  # True: a complete call; False: not a call; None: not known yet
    end: int | None = None  # ok: where the call ends; not ok: where reading it stopped, if known
    name: str | None = None  # once known, and a known function
    arguments: str = ""  # the arguments' JSON text so far: a prefix of the final one, all of it when ok


class CallReader(ABC):
    """Reads the call that starts at ``start`` (not whitespace). ``read`` is
    given the whole output so far, one that only grows, and may keep its
    place between calls."""

    def __init__(self, parser: FormToolParser, start: int):
        self.names = parser.names
        self.start = start

    @abstractmethod
    def read(self, text: str) -> Reading: ...


@dataclass(frozen=True)
class CallForm:
    reader: type[CallReader]
    opening: tuple[str, ...]
    at_start: bool = False
    separator: str | None = None
    closing: tuple[str, ...] = ()


class FormToolParser(ToolParser):
    forms: ClassVar[tuple[CallForm, ...]]
    # The keys of a JSON call object that hold its arguments (its first such member counts).
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")

    def __init__(self, tools: list[dict[str, Any]]):
        super().__init__(tools)
        self.text = ""
        self.final = False
        self.out = StreamDelta()
        self.pos = 0  # text[:pos] has been told
        self.started = False  # the at-start forms were tried
        self.markers = {f.opening[0] for f in self.forms if not f.at_start}
        self.scan_from = 0  # where to look for the next marker
        # The open run: its form, where reading goes on, its calls so far, what comes next.
        self.form: CallForm | None = None
        self.cursor = 0
        self.count = 0
        self.expect = "call"  # or "next" (a separator or the closing), "closing"
        self.closed = 0  # closing tokens matched
        self.reader: CallReader | None = None
        # Calls told: how many, and of the one being read, whether it was and how much of its arguments.
        self.calls = 0
        self.told = False
        self.args_told = 0

    # ---- the contract ---------------------------------------------------------------
    def parse(self, text: str) -> ParsedOutput:
        delta = type(self)(self.tools)._read(text, final=True)
        names: dict[int, str] = {}
        args: dict[int, str] = {}
        for d in delta.calls:
            if d.name is not None:
                names[d.index] = d.name
            args[d.index] = args.get(d.index, "") + d.arguments
        calls = [ToolCall(names[i], json.dumps(json.loads(args[i]), ensure_ascii=False)) for i in sorted(names)]
        return ParsedOutput(delta.content, calls)

    def feed(self, text: str) -> StreamDelta:
        return self._read(text, final=False)

    def finish(self) -> StreamDelta:
        return self._read("", final=True)

    # ---- the state machine ------------------------------------------------------------
    def _read(self, text: str, final: bool) -> StreamDelta:
        self.text += text
        self.final = final
        self.out = StreamDelta()
        while self._find_run() if self.form is None else self._read_run():
            pass
        return self.out

    def _find_run(self) -> bool:
        """Content up to where a run opens; True to go on, False to wait for more text."""
        if not self.started:
            for form in self.forms:
                if form.at_start:
                    opened = self._open(form, 0)
                    if opened is not False:
                        return bool(opened)
            self.started = True
        found = [i for i in (self.text.find(m, self.scan_from) for m in self.markers) if i >= 0]
        if not found:
            tail = self.text[self.scan_from :]
            held = 0 if self.final else max((held_prefix(tail, m) for m in self.markers), default=0)
            self._content(len(self.text) - held)
            self.scan_from = self.pos  # no marker begins before
            return False
        at = min(found)
        self._content(at)
        for form in self.forms:
            if not form.at_start and self.text.startswith(form.opening[0], at):
                opened = self._open(form, at)
                if opened is not False:
                    return bool(opened)
        self.scan_from = at + 1
        return True

    def _open(self, form: CallForm, at: int) -> bool | None:
        """Opens a run of ``form`` at ``at`` if its opening is there (None: can't tell yet)."""
        pos = at
        for token in form.opening:
            ok, pos = match(self.text, pos, token)
            if not ok:
                return None if ok is None and not self.final else False
        self.form, self.cursor, self.count, self.expect, self.started = form, pos, 0, "call", True
        return True

    def _read_run(self) -> bool:
        assert self.form is not None
        if self.expect == "call":
            return self._read_call()
        if self.expect == "next":
            if self.form.separator is not None:
                ok, end = match(self.text, self.pos, self.form.separator)
                if ok is None and not self.final:
                    return False
                if ok:
                    self.cursor, self.expect = end, "call"
                    return True
            self.expect, self.closed = "closing", 0
        for token in self.form.closing[self.closed :]:
            ok, end = match(self.text, self.pos, token)
            if ok is None and not self.final:
                return False
            if not ok:
                break
            self.pos, self.closed = end, self.closed + 1
        self._end_run(self.pos)
        return True

    def _read_call(self) -> bool:
        assert self.form is not None
        if self.reader is None:
            start = skip_ws(self.text, self.cursor)
            if start == len(self.text) and not self.final:
                return False
            self.reader = self.form.reader(self, start)
        reading = self.reader.read(self.text)
        if reading.ok is None and self.final:
            reading = replace(reading, ok=False)
        if reading.ok is None:
            self._tell(reading)
            return False
        self.reader = None
        if reading.ok:
            self._tell(reading)
            assert reading.end is not None
            self.pos = reading.end
        elif self.told:  # told in part: it cannot be taken back, so its text is dropped
            self.pos = len(self.text) if reading.end is None else reading.end
        else:  # not a call: the run ends before it, and the rest is content (a marker there opens no run)
            self._end_run(self.pos + 1 if self.count == 0 and not self.form.at_start else self.pos)
            return True
        self.told, self.count, self.expect = False, self.count + 1, "next"
        return True

    def _end_run(self, scan_from: int) -> None:
        self.form, self.reader, self.scan_from = None, None, scan_from

    # ---- output ---------------------------------------------------------------------------
    def _content(self, end: int) -> None:
        self.out.content += self.text[self.pos : end]
        self.pos = end

    def _tell(self, reading: Reading) -> None:
        if reading.name is None:
            return
        name = None
        if not self.told:
            self.told, self.args_told, name = True, 0, reading.name
            self.calls += 1
        fragment = reading.arguments[self.args_told :]
        self.args_told = len(reading.arguments)
        if name is None and not fragment:
            return
        index = self.calls - 1
        last = self.out.calls[-1] if self.out.calls else None
        if last is not None and last.index == index:
            self.out.calls[-1] = ToolCallDelta(index, last.name, last.arguments + fragment)
        else:
            self.out.calls.append(ToolCallDelta(index, name, fragment))
