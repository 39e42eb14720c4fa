"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}``
objects (``"arguments"`` also read) separated by ``;``, after a
``<|python_tag|>`` anywhere in the output or at its very start (the tag is a
special token, gone from the text when special tokens are skipped)."""

from __future__ import annotations

from radixserve.tool_parsers.forms import CallForm, FormToolParser
from radixserve.tool_parsers.json_calls import JSONCallReader


class Llama3JSONToolParser(FormToolParser):
    name = "llama3_json"
    priority = 10
    argument_keys = ("parameters", "arguments")
    forms = (
        CallForm(JSONCallReader, (), at_start=True, separator=";"),
        CallForm(JSONCallReader, ("<|python_tag|>",), separator=";"),
    )

    @classmethod
    def matches_template(cls, template: str) -> bool:
        # Meta's templates: the tag (built-in tools), the JSON format they ask for.
        return "<|python_tag|>" in template or "dictionary of argument name and its value" in template
