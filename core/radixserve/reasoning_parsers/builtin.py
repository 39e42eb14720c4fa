"""The built-in reasoning parsers, registered through the same hook as a third
party's (built-in plugin ``radixserve-reasoning-parsers``): ``qwen3`` (the
output reasons only if it opens with ``<think>``) and ``deepseek-r1`` (the
prompt opened the reasoning, so the output is reasoning up to ``</think>``; a
leading ``<think>`` is dropped too)."""

from __future__ import annotations

from radixserve.hooks import Register, hookimpl
from radixserve.reasoning_parsers.base import ReasoningParser

THINK_START, THINK_END = "<think>", "</think>"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    start, end = THINK_START, THINK_END
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek-r1"
    start, end = THINK_START, THINK_END
    starts_in_reasoning = True


@hookimpl
def register_reasoning_parsers(register: Register) -> None:
    for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser):
        register(parser)
