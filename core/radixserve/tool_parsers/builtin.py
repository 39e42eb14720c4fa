"""The built-in tool parsers, registered through the same hook as a third
party's (built-in plugin ``radixserve-tool-parsers``): ``hermes`` (Hermes,
Qwen2.5, Qwen3: ``<tool_call>{...}</tool_call>``), ``llama3_json`` (Llama 3.x:
``<|python_tag|>{"name": ..., "parameters": ...}; {...}``), ``mistral``
(``[TOOL_CALLS][{...}]`` and ``[TOOL_CALLS]name[ARGS]{...}``) and ``pythonic``
(Llama 3.2 / 4 pythonic templates: ``[f(x=1), g(y="a")]``)."""

from __future__ import annotations

from radixserve.hooks import Register, hookimpl
from radixserve.tool_parsers.hermes import HermesToolParser
from radixserve.tool_parsers.llama3_json import Llama3JSONToolParser
from radixserve.tool_parsers.mistral import MistralToolParser
from radixserve.tool_parsers.pythonic import PythonicToolParser


@hookimpl
def register_tool_parsers(register: Register) -> None:
    for parser in (HermesToolParser, Llama3JSONToolParser, MistralToolParser, PythonicToolParser):
        register(parser)
