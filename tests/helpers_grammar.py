"""What the structured-output server tests share: schemas whose every instance
is short (so a babbling random-weight model closes them within max_tokens),
checks of an output against its constraint, and a slow grammar backend
registered through the real hook (an entry point on a path), and one chat
completion's text, streamed or not."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import jsonschema
import openai

MESSAGES = [{"role": "user", "content": "Answer."}]
MAX_TOKENS = 600

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "address": {"$ref": "#/$defs/address"},
        "contact": {"anyOf": [{"type": "boolean"}, {"$ref": "#/$defs/phone"}]},
    },
    "required": ["name", "age", "role", "tags", "address", "contact"],
    "additionalProperties": False,
    "$defs": {
        "address": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "phone": {
            "type": "object",
            "properties": {"number": {"type": "string", "pattern": "^\\+[0-9]{3,6}$"}},
            "required": ["number"],
            "additionalProperties": False,
        },
    },
}
POINTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "ok": {"type": "boolean"}},
        "required": ["x", "ok"],
        "additionalProperties": False,
    },
    "minItems": 2,
    "maxItems": 4,
}
REGEX = r"(cat|dog)-[0-9]{2,4}( [a-z]{1,5}){0,3}"
# A digit, a parenthesised sum of two, or two of those joined by + or * (bounded, so a babbling model ends it).
EBNF = 'root ::= expr\nexpr ::= term | term op term\nop ::= "+" | "*"\nterm ::= [0-9] | "(" [0-9] "+" [0-9] ")"'


def check_schema(text: str, schema: dict[str, Any]) -> None:
    # strict=False: xgrammar 0.2 lets a string hold raw control characters other than \n and \r
    # (JSON wants them escaped); everything else about the text must be JSON and match the schema.
    jsonschema.validate(json.loads(text, strict=False), schema)


def check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def check_ebnf(text: str) -> None:
    """``text`` derives from EBNF's root (a recursive-descent parse)."""

    def term(i: int) -> int:
        if i < len(text) and text[i].isdigit():
            return i + 1
        assert text[i : i + 1] == "(" and text[i + 1 : i + 2].isdigit() and text[i + 2 : i + 3] == "+", text
        assert text[i + 3 : i + 4].isdigit() and text[i + 4 : i + 5] == ")", text
        return i + 5

    i = term(0)
    if i < len(text):
        assert text[i] in "+*", text
        i = term(i + 1)
    assert i == len(text), text


SLOW_BACKEND = '''
    import json
    import time

    from radixserve.structured_output.xgrammar_backend import XGrammarBackend
    from radixserve.hooks import hookimpl


    class SlowXGrammar(XGrammarBackend):
        """xgrammar, but a JSON schema with "description": "sleep:N" compiles N seconds longer."""

        name = "slow_xgrammar"
        priority = -1

        def compile(self, spec):
            if spec.kind == "json_schema":
                description = str(json.loads(spec.text).get("description", ""))
                if description.startswith("sleep:"):
                    time.sleep(float(description[6:]))
            return super().compile(spec)


    @hookimpl
    def register_grammar_backends(register):
        register(SlowXGrammar)
'''


def slow_backend_path(root: Path) -> Path:
    """A directory holding the slow backend as an installed plugin (dist-info + entry point)."""
    (root / "slow_grammar.py").write_text(textwrap.dedent(SLOW_BACKEND))
    info = root / "slow_grammar-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: slow-grammar\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[radixserve]\nslow_grammar = slow_grammar\n")
    return root


def slow_schema(seconds: float, tag: str) -> dict[str, Any]:
    """A short schema that the slow backend compiles for ``seconds`` (``tag`` keeps it out of the cache)."""
    return {"type": "string", "enum": ["yes", "no", tag], "description": f"sleep:{seconds}"}


async def chat_text(client: openai.AsyncOpenAI, stream: bool, **kw: Any) -> tuple[str, str]:
    """(text, finish_reason) of one chat completion of ``MESSAGES``, streamed or not."""
    args = {"model": "tiny", "messages": MESSAGES, "temperature": 1.0, "max_tokens": MAX_TOKENS, **kw}
    if not stream:
        out = await client.chat.completions.create(**args)
        return out.choices[0].message.content or "", out.choices[0].finish_reason
    text, reason = "", None
    async for chunk in await client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason
