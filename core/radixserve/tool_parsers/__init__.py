"""The built-in tool parsers, registered through the same hook as a third
party's (built-in plugin ``radixserve-tool-parsers``): ``hermes`` (Hermes,
Qwen2.5, Qwen3: ``<tool_call>{...}</tool_call>``)."""

from __future__ import annotations

from radixserve.hooks import Register, hookimpl
from radixserve.tool_parsers.hermes import HermesToolParser


@hookimpl
def register_tool_parsers(register: Register) -> None:
    register(HermesToolParser)
