"""Hermes, Qwen2.5, Qwen3: each call a JSON object between tags,
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (a missing
closing tag at the end of the output is forgiven, as vLLM does)."""

from __future__ import annotations

from radixserve.tool_parsers.forms import CallForm, FormToolParser
from radixserve.tool_parsers.json_calls import JSONCallReader


class HermesToolParser(FormToolParser):
    name = "hermes"
    priority = 10
    forms = (CallForm(JSONCallReader, ("<tool_call>",), closing=("</tool_call>",)),)

    @classmethod
    def matches_template(cls, template: str) -> bool:
        return "<tool_call>" in template
