"""Structured output through a real server and the official openai client.

The tiny model has random weights, so unconstrained it babbles: every output
that parses, validates or matches here does so because of its constraint.
Servers: the session's plain tiny_server (xgrammar, the default backend), and
the module's slow backend (xgrammar that sleeps on request, registered through
the real hook) for the compile queue: other requests run while a grammar
compiles, a compile past --grammar-compile-timeout is a 400, a client leaving
during a compile leaves the KV pool whole. The compile times and the timeout
are as short as leave each side a margin on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers_grammar import (
    EBNF,
    MAX_TOKENS,
    MESSAGES,
    PERSON,
    POINTS,
    REGEX,
    chat_text,
    check_ebnf,
    check_regex,
    check_schema,
    slow_backend_path,
    slow_schema,
)
from helpers_pool import ServerPool, assert_whole_pool_back
from helpers_server import PRIORITY_BACKENDS, ServerProcess, serving, wait_until_async

# A compile that must finish (COMPILES_S) stays under the timeout by as much as before (6 s vs 4 s);
# one that must time out (TIMES_OUT_S) takes twice the timeout. The backend's tokenizer, which the
# first compile loads, is loaded by the fixture, outside the timed tests.
COMPILE_TIMEOUT_S, COMPILES_S, TIMES_OUT_S = 4.0, 2.0, 8.0


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    return tiny_server


@pytest.fixture(scope="module")
def slow_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = slow_backend_path(tmp_path_factory.mktemp("slow_grammar"))
    env = {"PYTHONPATH": f"{path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    flags = ("--grammar-backend", "slow_xgrammar", "--grammar-compile-timeout", f"{COMPILE_TIMEOUT_S:g}")
    with serving(tiny_llama_dir, *flags, "--max-total-tokens", "8192", *PRIORITY_BACKENDS, env=env) as srv:
        warm = {"text": "Go:", "sampling_params": {"regex": "(yes|no)", "max_new_tokens": 4}}
        assert httpx.post(srv.url + "/generate", json=warm, timeout=120).status_code == 200
        yield srv


def _client(srv: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)


async def _completion(client: openai.AsyncOpenAI, stream: bool, **kw: Any) -> tuple[str, str]:
    args = {"model": "tiny", "prompt": "Go:", "temperature": 1.0, "max_tokens": MAX_TOKENS, **kw}
    if not stream:
        out = await client.completions.create(**args)
        return out.choices[0].text, out.choices[0].finish_reason
    text, reason = "", None
    async for chunk in await client.completions.create(stream=True, **args):
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


def _counts(url: str) -> tuple[int, int]:
    """(running, queued) as the scheduler reports them."""
    stats = httpx.get(url + "/server_info", timeout=30).json()["stats"]
    return stats["num_running_reqs"], stats["num_queue_reqs"]


def _response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_outputs_validate_over_50_seeds(server: ServerProcess) -> None:
    """Nested objects, enums, arrays with minItems/maxItems, string patterns,
    anyOf and $ref; streamed and not; 60 seeds at temperature 1.0."""

    async def run() -> list[tuple[dict, str, str]]:
        async with _client(server) as client:
            jobs = []
            for seed in range(60):
                schema = PERSON if seed % 3 else POINTS
                fmt = _response_format(schema)
                jobs.append((schema, chat_text(client, stream=seed % 2 == 1, seed=seed, response_format=fmt)))
            outs = await asyncio.gather(*(job for _, job in jobs))
            return [(schema, text, reason) for (schema, _), (text, reason) in zip(jobs, outs, strict=False)]

    for schema, text, reason in asyncio.run(run()):
        assert reason == "stop", text
        check_schema(text, schema)


def test_regex_ebnf_and_their_aliases_over_50_seeds(server: ServerProcess) -> None:
    """SGLang's and vLLM's spellings, on completions and chat, streamed and not."""
    regex_fields = [{"regex": REGEX}, {"guided_regex": REGEX}, {"structured_outputs": {"regex": REGEX}}]
    ebnf_fields = [{"ebnf": EBNF}, {"guided_grammar": EBNF}, {"structured_outputs": {"grammar": EBNF}}]

    async def run() -> list[tuple[str, str, str]]:
        async with _client(server) as client:
            jobs = []
            for seed in range(30):
                extra = regex_fields[seed % 3]
                jobs.append(("regex", _completion(client, stream=seed % 2 == 0, seed=seed, extra_body=extra)))
                extra = ebnf_fields[seed % 3]
                jobs.append(("ebnf", chat_text(client, stream=seed % 2 == 1, seed=seed, extra_body=extra)))
            outs = await asyncio.gather(*(job for _, job in jobs))
            return [(kind, text, reason) for (kind, _), (text, reason) in zip(jobs, outs, strict=False)]

    for kind, text, reason in asyncio.run(run()):
        assert reason == "stop", text
        (check_regex if kind == "regex" else check_ebnf)(text)


def test_choice_json_object_and_n(server: ServerProcess, tiny_tokenizer: Any) -> None:
    choices = ["alpha", "beta", "gamma delta"]
    # Random weights rarely close a string or an object: a bias only shortens the wait, the grammar decides.
    closers = {str(tiny_tokenizer.convert_tokens_to_ids(ch)): 6.0 for ch in '"}'}

    async def run() -> tuple[Any, list[tuple[str, str]]]:
        async with _client(server) as client:
            picked = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, n=4, seed=3, max_tokens=20, extra_body={"guided_choice": choices}
            )
            objects = await asyncio.gather(
                *(
                    chat_text(
                        client, stream=s % 2 == 0, seed=s, response_format={"type": "json_object"}, logit_bias=closers
                    )
                    for s in range(6)
                )
            )
            return picked, objects

    picked, objects = asyncio.run(run())
    assert len(picked.choices) == 4
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in picked.choices)
    for text, reason in objects:
        assert reason == "stop" and isinstance(json.loads(text, strict=False), dict), text


def test_generate_takes_sglang_sampling_params(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=300) as http:
        out = http.post(
            "/generate",
            json={"text": "Go:", "sampling_params": {"regex": REGEX, "max_new_tokens": MAX_TOKENS, "seed": 1}},
        ).json()
        check_regex(out["text"])
        schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
        params = {"json_schema": json.dumps(schema), "max_new_tokens": MAX_TOKENS, "seed": 2}
        check_schema(http.post("/generate", json={"text": "Go:", "sampling_params": params}).json()["text"], schema)


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(server: ServerProcess) -> None:
    """Greedy outputs are token-identical alone and in a batch with constrained requests."""
    prompts = ["The cat", "A dog ran", "Numbers: 1 2 3", "Hello"]

    async def generate(http: httpx.AsyncClient, text: str, **params: Any) -> list[int]:
        body = {"text": text, "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, **params}}
        response = await http.post("/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()["output_ids"]

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            alone = await asyncio.gather(*(generate(http, p) for p in prompts))
            constrained = [generate(http, "x", regex=REGEX, temperature=1.0, seed=s) for s in range(8)]
            mixed = await asyncio.gather(*(generate(http, p) for p in prompts), *constrained)
            return list(alone), list(mixed[: len(prompts)])

    alone, mixed = asyncio.run(run())
    assert alone == mixed


@pytest.mark.parametrize(
    ("extra", "param", "kind"),
    [
        ({"json_schema": "{not json"}, "json_schema", "json schema"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
        ({"ebnf": "root ::= ("}, "ebnf", "ebnf"),
        (
            {"response_format": _response_format({"type": "object", "properties": {"a": {"type": "nonsense"}}})},
            "response_format",
            "json schema",
        ),
    ],
)
def test_bad_constraints_are_400s_with_the_compilers_message(
    server: ServerProcess, extra: dict, param: str, kind: str
) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, extra_body=extra)
    error = info.value.body
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: invalid {kind}: ") and len(error["message"]) > len(param) + 20
    # The server keeps serving. ignore_eos: the shared server's sampler has served other modules before,
    # so an unseeded sample may be anything, an early end of sequence too.
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body={"ignore_eos": True})
    assert ok.choices[0].finish_reason == "length"


def test_two_constraints_are_a_400_naming_them(server: ServerProcess) -> None:
    response = httpx.post(
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "regex": "a", "guided_choice": ["b"]},
        timeout=60,
    )
    assert response.status_code == 400
    assert "regex, guided_choice" in response.json()["error"]["message"]
    response = httpx.post(
        server.url + "/generate", json={"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "sampling_params.regex"


def test_server_info_reports_structured_output(server: ServerProcess) -> None:
    info = httpx.get(server.url + "/server_info", timeout=60).json()
    assert info["worker"]["features"]["structured_output"] is True
    assert info["grammar_backend"] == "xgrammar"


# ---- the compile queue (slow backend) ---------------------------------------------


def test_a_compiling_grammar_does_not_delay_other_requests(slow_server: ServerProcess) -> None:
    async def timed(job: Any) -> tuple[float, Any]:
        out = await job
        return time.monotonic(), out

    async def run() -> tuple[tuple[float, Any], list[tuple[float, Any]], float]:
        async with _client(slow_server) as client:
            started = time.monotonic()
            slow = asyncio.ensure_future(
                timed(
                    chat_text(
                        client, stream=False, seed=1, response_format=_response_format(slow_schema(COMPILES_S, "q1"))
                    )
                )
            )
            # Compiling counts as queued: the request waits there, nothing runs.
            assert await wait_until_async(lambda: _counts(slow_server.url) == (0, 1), COMPILES_S)
            others = await asyncio.gather(
                *(timed(_completion(client, stream=s % 2 == 0, seed=s, max_tokens=8)) for s in range(4))
            )
            return await slow, others, started

    (slow_done, (text, reason)), others, started = asyncio.run(run())
    assert reason == "stop" and json.loads(text) in ("yes", "no", "q1")
    assert slow_done - started >= COMPILES_S
    assert all(done < slow_done for done, _ in others)  # each finished while the grammar was compiling


def test_a_compile_past_the_timeout_is_a_400_naming_the_flag(slow_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=8,
            response_format=_response_format(slow_schema(TIMES_OUT_S, "q2")),
        )
    assert COMPILE_TIMEOUT_S <= time.monotonic() - started < TIMES_OUT_S
    assert info.value.body["param"] == "response_format"
    assert f"--grammar-compile-timeout ({COMPILE_TIMEOUT_S:g} s)" in info.value.body["message"]


def test_a_client_leaving_during_a_compile_frees_everything(slow_server: ServerProcess) -> None:
    """The client leaves while its grammar compiles; the compile completes after the abort and the
    request must not start then. A second request with the same schema joins that compile (the
    compiler's cache; a compile of its own would end later still), so it is answered after the
    compile's end; it alone has generated tokens since the first client left."""
    fmt = _response_format(slow_schema(COMPILES_S, "q3"))
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 64, "stream": True, "response_format": fmt}

    async def leave_early() -> None:
        async with httpx.AsyncClient(base_url=slow_server.url, timeout=60) as http:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(http.post("/v1/chat/completions", json=body), timeout=0.5)

    asyncio.run(leave_early())
    pool = ServerPool(slow_server.url)
    before = pool.stats()["generation_tokens_total"]
    client = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    after_compile = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, response_format=fmt)
    assert_whole_pool_back(pool)
    stats = pool.stats()
    assert stats["num_running_reqs"] == 0 and stats["num_queue_reqs"] == 0
    assert stats["generation_tokens_total"] - before == after_compile.usage.completion_tokens
