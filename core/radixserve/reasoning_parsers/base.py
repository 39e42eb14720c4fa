"""Reasoning output: the contract between the core and reasoning parsers.

A reasoning parser (registered through the ``register_reasoning_parsers`` hook,
chosen by ``--reasoning-parser``) splits a model's chat output into
``reasoning_content`` and ``content``. It declares:

- ``name``: what ``--reasoning-parser`` calls it;
- ``start`` and ``end``: the tags around the reasoning, as text. The server
  also encodes them to token ids so that a grammar (``response_format``, a
  ``tool_choice``) applies only after the reasoning
  (``structured_output.backend.ReasoningGate``);
- ``starts_in_reasoning``: whether the output is reasoning from its first
  token (the chat template opened the reasoning in the prompt, as
  DeepSeek-R1's does) rather than only when it opens with ``start``.

``ReasoningParser`` implements the split from these: ``parse`` the whole
output, ``feed`` each streamed piece then ``finish``. The output reasons if it
opens with ``start`` (leading whitespace allowed; the tag is dropped) or
``starts_in_reasoning``; the reasoning runs up to ``end`` (dropped), the rest
is content; without ``end`` everything after the opening is reasoning. A
subclass may override the three methods for another format, keeping the rule
that the streamed pieces concatenate to exactly the whole split however the
text is cut (tags split across pieces included). One instance serves one output.
"""

from __future__ import annotations

from typing import ClassVar


def held_back(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that could begin ``tag`` (held back while streaming)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Splits one output into ``(reasoning, content)``, whole or streamed."""

    name: ClassVar[str]
    start: ClassVar[str]
    end: ClassVar[str]
    starts_in_reasoning: ClassVar[bool] = False

    def __init__(self) -> None:
        self.phase = "start"  # start (undecided), reasoning, content
        self.buffer = ""

    def parse(self, text: str) -> tuple[str | None, str]:
        """``(reasoning_content, content)``; reasoning is None when the output did not reason."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start) :]
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, text
        reasoning, found, content = body.partition(self.end)
        return reasoning, content if found else ""

    def feed(self, delta: str) -> tuple[str, str]:
        """The next streamed piece of output as ``(reasoning delta, content delta)``."""
        self.buffer += delta
        reasoning = content = ""
        if self.phase == "start":
            stripped = self.buffer.lstrip()
            if not stripped or (self.start.startswith(stripped) and stripped != self.start):
                return "", ""  # may still become the start tag
            if stripped.startswith(self.start):
                self.buffer = stripped[len(self.start) :]
                self.phase = "reasoning"
            else:
                self.phase = "reasoning" if self.starts_in_reasoning else "content"
        if self.phase == "reasoning":
            before, found, after = self.buffer.partition(self.end)
            if found:
                reasoning, self.buffer, self.phase = before, after, "content"
            else:
                cut = len(self.buffer) - held_back(self.buffer, self.end)
                reasoning, self.buffer = self.buffer[:cut], self.buffer[cut:]
        if self.phase == "content":
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What the stream still holds when the output ends."""
        rest, self.buffer = self.buffer, ""
        if self.phase == "start":
            return (rest, "") if self.starts_in_reasoning else ("", rest)
        return (rest, "") if self.phase == "reasoning" else ("", rest)
