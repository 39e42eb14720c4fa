"""The HTTP server against real clients (the official ``openai`` package and
httpx): one `radixserve serve` subprocess on the tiny Llama, shared with
test_hostile_inputs.py (helpers_shared_servers); every check of its state
counts this module's own traffic (before/after) or waits for it to settle."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from helpers_pool import ServerPool, assert_whole_pool_back, idle
from helpers_server import ServerProcess, SharedServer, wait_until
from helpers_shared_servers import API_KEY, GUARDED_MAX_TOTAL_TOKENS, MAX_PAYLOAD
from prometheus_client.parser import text_string_to_metric_families

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(guarded_servers: SharedServer) -> ServerProcess:
    """--api-key API_KEY and --max-payload-size MAX_PAYLOAD (shared with test_hostile_inputs.py:
    helpers_shared_servers)."""
    return guarded_servers.get()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def chat(client, content="Tell me a story", **kw):
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


def pool(server) -> ServerPool:
    return ServerPool(server.url, server.auth_headers)


# ---- models, chat, completions ------------------------------------------------------------
def test_models(client, http):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    missing = http.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_chat_streaming_matches_non_streaming(client):
    messages_kw = dict(content="Hello there", max_tokens=16, **GREEDY)
    full = chat(client, **messages_kw)
    assert full.object == "chat.completion" and full.model == "tiny" and full.id.startswith("chatcmpl-")
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 16
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **messages_kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    body, usage_chunks = chunks[:-1], [c for c in chunks if c.usage is not None]
    assert usage_chunks == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]


def test_chat_message_shapes(client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "and?"},
    ]
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=3, user="u1")
    assert out.usage.completion_tokens <= 3
    cont = client.chat.completions.create(
        model="tiny",
        max_tokens=2,
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert cont.usage.completion_tokens <= 2


def test_completions_prompt_forms_and_indices(client, http):
    ids = http.post("/tokenize", json={"prompt": "the cache tree"}).json()["tokens"]
    by_text = client.completions.create(model="tiny", prompt="the cache tree", max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, **GREEDY)
    assert by_text.choices[0].text == by_ids.choices[0].text
    batch = client.completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=6, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 2
    assert 0 < batch.usage.completion_tokens <= 4 * 6
    texts = client.completions.create(model="tiny", prompt=["alpha", "beta"], max_tokens=4, **GREEDY)
    assert len(texts.choices) == 2

    stream = client.completions.create(
        model="tiny", prompt=[ids, ids[:2]], max_tokens=6, stream=True, **GREEDY, stream_options={"include_usage": True}
    )
    streamed: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            finishes[c.index] = finishes.get(c.index, 0) + (c.finish_reason is not None)
    assert streamed[0] == by_text.choices[0].text and streamed[1] == batch.choices[2].text
    assert finishes == {0: 1, 1: 1}


def test_n2_with_logprobs(client):
    out = chat(client, n=2, logprobs=True, top_logprobs=3, temperature=1.0, seed=7, max_tokens=8)
    assert [c.index for c in out.choices] == [0, 1]
    total = 0
    for c in out.choices:
        content = c.logprobs.content
        total += len(content)
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3 and isinstance(entry.bytes, list)
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-5
    assert total == out.usage.completion_tokens

    stream = chat(client, n=2, logprobs=True, top_logprobs=2, max_tokens=6, stream=True, **GREEDY)
    roles, finishes, counted = {}, {}, {0: 0, 1: 0}
    for chunk in stream:
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            finishes[c.index] = finishes.get(c.index, 0) + (c.finish_reason is not None)
            counted[c.index] += len(c.logprobs.content) if c.logprobs else 0
    assert roles == {0: "assistant", 1: "assistant"} and finishes == {0: 1, 1: 1}
    assert all(0 < n <= 6 for n in counted.values())

    legacy = client.completions.create(model="tiny", prompt="token logprobs", max_tokens=5, n=2, logprobs=2, **GREEDY)
    for c in legacy.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_stop_strings_and_stop_token_ids(client, http):
    free = client.completions.create(model="tiny", prompt="stop here", max_tokens=24, **GREEDY)
    text = free.choices[0].text
    ascii_runs = [i for i in range(4, len(text) - 3) if text[i : i + 3].isascii() and text[i : i + 3].strip()]
    assert ascii_runs, f"no ASCII stretch to stop on in {text!r}"
    stop = text[ascii_runs[0] : ascii_runs[0] + 3]
    stopped = client.completions.create(model="tiny", prompt="stop here", max_tokens=24, stop=[stop, "@@@"], **GREEDY)
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.matched_stop == stop
    assert choice.text == text[: text.find(stop)]

    native = http.post(
        "/generate", json={"text": "stop here", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    ).json()
    token = native["output_ids"][5]
    by_id = client.completions.create(
        model="tiny", prompt="stop here", max_tokens=24, **GREEDY, extra_body={"stop_token_ids": [token]}
    )
    assert by_id.choices[0].finish_reason == "stop" and by_id.choices[0].matched_stop == token
    assert by_id.usage.completion_tokens == native["output_ids"].index(token) + 1

    streamed = client.completions.create(
        model="tiny", prompt="stop here", max_tokens=24, stop=stop, stream=True, **GREEDY
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].matched_stop == stop


def test_echo(client):
    plain = client.completions.create(model="tiny", prompt="echo me", max_tokens=4, **GREEDY)
    echoed = client.completions.create(model="tiny", prompt="echo me", max_tokens=4, echo=True, logprobs=1, **GREEDY)
    assert echoed.choices[0].text == "echo me" + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == echoed.usage.prompt_tokens + echoed.usage.completion_tokens
    assert "".join(lp.tokens[: echoed.usage.prompt_tokens]) == "echo me"
    chunks = list(
        client.completions.create(model="tiny", prompt="echo me", max_tokens=4, echo=True, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_seed_reproducibility(client):
    def sample(seed):
        out = chat(client, "Pick anything", temperature=1.0, top_p=0.95, seed=seed, max_tokens=16)
        return out.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2))


def test_sampling_extras_accepted(client):
    out = chat(
        client,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"300": 5.0},
        max_tokens=4,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 4,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "chat_template_kwargs": {"unused": 1},
        },
    )
    assert out.usage.completion_tokens == 4


def test_default_max_tokens_uses_remaining_context(client, http):
    context = http.get("/get_model_info").json()["context_length"]
    prompt = [10 + i % 400 for i in range(context - 5)]
    out = client.completions.create(model="tiny", prompt=prompt, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


# ---- errors ----------------------------------------------------------------------------------
LONG = "word " * 3000
ERROR_CASES = [
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1},
        400,
        "temperature",
    ),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": "many"}, 400, "n"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        },
        400,
        None,
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "stream": True},
        400,
        "messages",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 5000, "stream": True}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 3}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ""}, 400, "stop"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, 400, "sampling_params"),
    ("/generate", {"input_ids": [10**9]}, 400, "input_ids"),
    ("/generate", {"sampling_params": {}}, 400, "text"),
    ("/generate", {"text": []}, 400, "text"),
    ("/generate", {"text": [], "stream": True}, 400, "text"),
    ("/generate", {"input_ids": []}, 400, "input_ids"),
    ("/generate", {"input_ids": [[]]}, 400, "input_ids"),
    ("/generate", {"input_ids": [], "stream": True}, 400, "input_ids"),
    ("/generate", {"text": ["a", "b"], "priority": [1]}, 400, "priority"),
    ("/generate", {"text": "x", "priority": "high"}, 400, "priority"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "priority": "high"}, 400, "priority"),
]


@pytest.mark.parametrize("path,body,status,param", ERROR_CASES)
def test_error_statuses_and_envelope(http, path, body, status, param):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_transport_level_errors(server, http):
    malformed = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and "JSON" in malformed.json()["error"]["message"]
    unknown = http.get("/no/such/route")
    assert unknown.status_code == 404 and "error" in unknown.json()
    too_big = http.post("/v1/completions", json={"model": "tiny", "prompt": "x" * (MAX_PAYLOAD + 1)})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "payload_too_large"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        denied = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=10**6, stream=True)
    assert info.value.param == "max_tokens"


# ---- native API and introspection ------------------------------------------------------------
def test_native_generate(http):
    one = http.post(
        "/generate",
        json={
            "text": "native",
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        },
    ).json()
    meta = one["meta_info"]
    assert meta["completion_tokens"] == len(one["output_ids"]) == 5
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert len(meta["output_top_logprobs"][0]) == 2 and meta["finish_reason"]["type"] == "length"
    batch = http.post(
        "/generate", json={"input_ids": [[10, 11, 12], [13, 14]], "sampling_params": {"max_new_tokens": 3, "n": 2}}
    ).json()
    assert isinstance(batch, list) and len(batch) == 4 and "output_token_logprobs" not in batch[0]["meta_info"]

    with http.stream(
        "POST",
        "/generate",
        json={"text": "native", "stream": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
    ) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["text"] == one["text"] and chunks[-1]["output_ids"] == one["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:], strict=False))  # cumulative


def test_priority_is_accepted(client, http):
    out = client.completions.create(model="tiny", prompt="first", max_tokens=2, extra_body={"priority": 5})
    assert out.usage.completion_tokens <= 2
    out = chat(client, max_tokens=2, extra_body={"priority": -1})
    assert out.usage.completion_tokens <= 2
    batch = http.post(
        "/generate", json={"text": ["a", "b"], "priority": [2, 1], "sampling_params": {"max_new_tokens": 2}}
    )
    assert batch.status_code == 200 and len(batch.json()) == 2


def test_tokenize_detokenize(http):
    tokens = http.post("/tokenize", json={"prompt": "round trip ✓"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["text"] == "round trip ✓"


def test_server_and_model_info(http):
    info = http.get("/get_server_info").json()
    assert info["served_model_name"] == "tiny" and info["server_args"]["api_key"] == "<redacted>"
    assert info["backends"]["attention"] and info["max_total_tokens"] == GUARDED_MAX_TOTAL_TOKENS
    assert set(info["pids"]) == {"scheduler", "detokenizer"}
    assert {"num_running_reqs", "num_queue_reqs", "memory_invariant_ok", "free_tokens"} <= set(info["stats"])
    model = http.get("/get_model_info").json()
    assert model["has_chat_template"] and model["context_length"] == 1024
    assert http.get("/health_generate").status_code == 200
    assert wait_until(lambda: http.post("/flush_cache").status_code == 200, timeout=10)


def test_metrics(client, http):
    list(chat(client, stream=True, max_tokens=4))
    chat(client, max_tokens=4)
    text = httpx.get(http.base_url.join("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = [
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "cache_hit_rate",
        "num_retracted_reqs",
        "prompt_tokens",
        "generation_tokens",
        "cached_tokens",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ]
    for name in expected:
        family = families["radixserve:" + name]
        assert family.samples and all(s.labels.get("model_name") == "tiny" for s in family.samples), name
    value = {s.name: s.value for f in families.values() for s in f.samples}
    assert value["radixserve:prompt_tokens_total"] > 0 and value["radixserve:generation_tokens_total"] > 0
    assert value["radixserve:e2e_request_latency_seconds_count"] >= 2
    assert value["radixserve:time_to_first_token_seconds_count"] >= 2


# ---- streaming text, parity with the Engine ------------------------------------------------------
def test_streamed_multibyte_text_matches_non_streamed(client, http):
    """Bias generation toward the byte tokens of CJK and emoji characters, so
    characters are split across tokens; streamed deltas must still join into
    exactly the non-streamed text."""
    tokenizer_ids = set()
    for ch in "é你好🚀😀":
        tokenizer_ids.update(http.post("/tokenize", json={"prompt": ch}).json()["tokens"])
    bias = {str(i): 100 for i in tokenizer_ids}
    multibyte_outputs = 0
    for k in range(8):
        kw = dict(model="tiny", prompt=f"prompt {k}", max_tokens=24, logit_bias=bias, **GREEDY)
        full = client.completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        assert streamed == full
        multibyte_outputs += any(ord(ch) > 0x7F and ch != "\ufffd" for ch in full)
    assert multibyte_outputs >= 3, "the biased model should have produced multi-byte characters"


def test_greedy_results_equal_the_offline_engine(http, engine):
    prompts = ["The radix tree", "hello world", "a much longer prompt about batching and latency"]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    served = http.post("/generate", json={"text": prompts, "sampling_params": params}).json()
    offline = engine.generate(prompts, params)
    assert [s["output_ids"] for s in served] == [o["output_ids"] for o in offline]
    assert [s["text"] for s in served] == [o["text"] for o in offline]


# ---- concurrency, disconnects, aborts ----------------------------------------------------------------
def test_64_concurrent_streams(server, tiny_tokenizer):

    def messages(i: int) -> list[dict]:
        return [{"role": "user", "content": f"request number {i}"}]

    async def one(aclient: openai.AsyncOpenAI, i: int):
        stream = await aclient.chat.completions.create(
            model="tiny",
            messages=messages(i),
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finishes = "", None, 0
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                finishes += c.finish_reason is not None
            usage = chunk.usage or usage
        return text, usage, finishes

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    for i, (_text, usage, finishes) in enumerate(results):
        assert finishes == 1 and usage.completion_tokens == 16
        prompt = tiny_tokenizer.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=False)
        assert usage.prompt_tokens == len(tiny_tokenizer.encode(prompt, add_special_tokens=False))
        assert usage.total_tokens == usage.prompt_tokens + 16
    assert wait_until(lambda: idle(pool(server).stats()), timeout=10), pool(server).stats()


def test_client_disconnect_aborts_the_request(server, http):
    before = pool(server).stats()["generation_tokens_total"]
    body = {"model": "tiny", "prompt": "keep going", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    # The client closed the connection: the request must stop and give back all its KV.
    assert wait_until(lambda: idle(pool(server).stats()), timeout=10), pool(server).stats()
    generated = pool(server).stats()["generation_tokens_total"] - before
    assert generated < 1000, "the request ran to completion instead of being aborted"
    assert http.get("/health").status_code == 200
    assert_whole_pool_back(pool(server))


def test_abort_request_endpoint(server, http):
    body = {
        "text": "abort me",
        "rid": "to-abort",
        "stream": True,
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
    }
    with http.stream("POST", "/generate", json=body) as response:
        last, aborted = None, False
        for line in response.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
                if not aborted and last["meta_info"]["completion_tokens"] >= 2:
                    assert http.post("/abort_request", json={"rid": "to-abort"}).json() == {"success": True}
                    aborted = True
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 1000
    assert_whole_pool_back(pool(server))
