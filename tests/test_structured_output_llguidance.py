"""Structured output through the second built-in backend, llguidance
(``--grammar-backend llguidance``): a smaller set than test_structured_output.py,
proving the interface serves another compiler alike."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers_grammar import EBNF, PERSON, POINTS, REGEX, chat_text, check_ebnf, check_regex, check_schema
from helpers_server import PRIORITY_BACKENDS, ServerProcess, serving


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    with serving(
        tiny_llama_dir, "--grammar-backend", "llguidance", "--max-total-tokens", "32768", *PRIORITY_BACKENDS
    ) as srv:
        yield srv


def test_llguidance_outputs_match_their_constraints(server: ServerProcess) -> None:
    async def run() -> list[tuple[str, object, tuple[str, str]]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600) as c:
            jobs: list[tuple[str, object]] = []
            for seed in range(12):
                schema = PERSON if seed % 2 else POINTS
                jobs.append(("schema", schema))
                jobs.append(("regex", None))
                jobs.append(("ebnf", None))
            calls = []
            for i, (kind, schema) in enumerate(jobs):
                extra = {"schema": {"guided_json": schema}, "regex": {"regex": REGEX}, "ebnf": {"ebnf": EBNF}}[kind]
                calls.append(chat_text(c, i % 2 == 0, seed=i, extra_body=extra))
            outs = await asyncio.gather(*calls)
            return [(kind, schema, out) for (kind, schema), out in zip(jobs, outs, strict=False)]

    for kind, schema, (text, reason) in asyncio.run(run()):
        assert reason == "stop", text
        if kind == "schema":
            check_schema(text, schema)  # type: ignore[arg-type]
        else:
            (check_regex if kind == "regex" else check_ebnf)(text)


def test_llguidance_choice_and_a_bad_regex(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    out = client.completions.create(
        model="tiny", prompt="Pick:", n=3, max_tokens=16, extra_body={"structured_outputs": {"choice": ["on", "off"]}}
    )
    assert all(c.text in ("on", "off") and c.finish_reason == "stop" for c in out.choices)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"regex": "(unclosed"})
    assert info.value.body["param"] == "regex"
    assert info.value.body["message"].startswith("regex: invalid regex: ")
    info_ = httpx.get(server.url + "/server_info", timeout=60).json()
    assert info_["grammar_backend"] == "llguidance" and info_["worker"]["features"]["structured_output"]
