"""Reasoning output (``--reasoning-parser``): chat output split into
``reasoning_content`` (between ``<think>`` and ``</think>``) and ``content``.

``qwen3``: the output reasons only if it opens with ``<think>`` (leading
whitespace allowed); ``deepseek-r1``: the prompt opened the reasoning, so the
output is reasoning up to ``</think>`` (a leading ``<think>`` is dropped too).
Without the end tag everything after the opening is reasoning. The streamed
split (``feed`` then ``finish``) concatenates to exactly the non-streamed one
(``parse``) however the text is cut, tags split across deltas included.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config import REASONING_PARSERS

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningStyle:
    start: str
    end: str
    starts_in_reasoning: bool


STYLES = {
    "qwen3": ReasoningStyle(START, END, starts_in_reasoning=False),
    "deepseek-r1": ReasoningStyle(START, END, starts_in_reasoning=True),
}
assert set(STYLES) == set(REASONING_PARSERS)


def _held(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that could begin ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, name: str):
        self.style = STYLES[name]
        self.phase = "start"  # start (undecided), reasoning, content
        self.buffer = ""

    def parse(self, text: str) -> tuple[str | None, str]:
        """``(reasoning_content, content)``; reasoning is None when the output did not reason."""
        style = self.style
        stripped = text.lstrip()
        if stripped.startswith(style.start):
            body = stripped[len(style.start) :]
        elif style.starts_in_reasoning:
            body = text
        else:
            return None, text
        reasoning, found, content = body.partition(style.end)
        return reasoning, content if found else ""

    def feed(self, delta: str) -> tuple[str, str]:
        """The next streamed piece of output as ``(reasoning delta, content delta)``."""
        style = self.style
        self.buffer += delta
        reasoning = content = ""
        if self.phase == "start":
            stripped = self.buffer.lstrip()
            if stripped and style.start.startswith(stripped) and stripped != style.start or not stripped:
                return "", ""  # may still become the start tag
            if stripped.startswith(style.start):
                self.buffer = stripped[len(style.start) :]
                self.phase = "reasoning"
            else:
                self.phase = "reasoning" if style.starts_in_reasoning else "content"
        if self.phase == "reasoning":
            before, found, after = self.buffer.partition(style.end)
            if found:
                reasoning, self.buffer, self.phase = before, after, "content"
            else:
                keep = _held(self.buffer, style.end)
                reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        if self.phase == "content":
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What the stream still holds when the output ends."""
        rest, self.buffer = self.buffer, ""
        if self.phase == "start":
            if self.style.starts_in_reasoning:
                return rest, ""
            return "", rest
        return (rest, "") if self.phase == "reasoning" else ("", rest)
