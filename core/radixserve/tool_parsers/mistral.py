"""Mistral's tool calls after ``[TOOL_CALLS]``: a JSON array of
``{"name": ..., "arguments": {...}}`` (tokenizers before v11), or one call a
marker, ``[TOOL_CALLS]name[ARGS]{...}`` (v11 on; ``[CALL_ID]id`` may come
before ``[ARGS]``, and ``[ARGS]`` may be missing where it was decoded away).
The markers are special tokens, so the outputs are decoded keeping them."""

from __future__ import annotations

import json
import re

from radixserve.tool_parsers.forms import CallForm, CallReader, FormToolParser, Reading, match, run_end, skip_ws
from radixserve.tool_parsers.json_calls import JSONCallReader, ValueExtent

_NAME = re.compile(r"[\w.-]*")
_CALL_ID = re.compile(r"\w*")


class CompactCallReader(CallReader):
    """``name[CALL_ID]id[ARGS]{...}``, the two marked parts optional."""

    def __init__(self, parser: FormToolParser, start: int):
        super().__init__(parser, start)
        self.extent: ValueExtent | None = None

    def read(self, text: str) -> Reading:
        end = run_end(_NAME, text, self.start)
        name = text[self.start : end]
        if end == len(text):
            return Reading(ok=None if any(n.startswith(name) for n in self.names) else False)
        if name not in self.names:
            return Reading(ok=False)
        for marker, rest in (("[CALL_ID]", _CALL_ID), ("[ARGS]", None)):
            found, end = match(text, end, marker)
            if found is None:
                return Reading()
            if found and rest is not None:
                end = run_end(rest, text, end)
        start = skip_ws(text, end)
        if start == len(text):
            return Reading()
        if text[start] != "{":
            return Reading(ok=False, end=start)
        if self.extent is None:
            self.extent = ValueExtent(start)
        args_end = self.extent.read(text)
        arguments = text[start : len(text) if args_end is None else args_end]
        if args_end is None:
            return Reading(name=name, arguments=arguments)
        try:
            json.loads(arguments)
        except ValueError:
            return Reading(ok=False, end=args_end)
        return Reading(ok=True, end=args_end, name=name, arguments=arguments)


class MistralToolParser(FormToolParser):
    name = "mistral"
    priority = 10
    special_tokens = True  # [TOOL_CALLS], [CALL_ID], [ARGS]
    forms = (
        CallForm(JSONCallReader, ("[TOOL_CALLS]", "["), separator=",", closing=("]",)),
        CallForm(CompactCallReader, ("[TOOL_CALLS]",)),
    )

    @classmethod
    def matches_template(cls, template: str) -> bool:
        return "[TOOL_CALLS]" in template
