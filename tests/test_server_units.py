"""Server pieces that need no running server: error mapping, request parsing,
logprob token bytes, chat templates, metrics registries, model sources and the
demo model cache."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ValidationError
from tokenizers import processors
from transformers import AutoTokenizer

from radixserve.checkpoints import demo as demo_model
from radixserve.checkpoints.random_model import build_llama_without_its_class, build_tiny_model
from radixserve.checkpoints.source import model_path_at_hand, resolve_model_path
from radixserve.config import ServerArgs
from radixserve.messages import FinishReason
from radixserve.sampling.params import SamplingParams
from radixserve.server import native_serving
from radixserve.server.chat_template import ChatTemplate
from radixserve.server.errors import APIError, _loc_to_param, bad_request, validation_summary
from radixserve.server.logprobs import TokenTexts, completion_logprobs
from radixserve.server.lora import ServedAdapters
from radixserve.server.metrics import ServerMetrics
from radixserve.server.openai_serving import OpenAIServing
from radixserve.server.protocol import (
    MAX_JSON_DEPTH,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequestBody,
    find_bad_json,
)
from radixserve.server.streaming import sse
from radixserve.server.tokenizer_manager import PreparedInput


@pytest.mark.parametrize(
    "message,renames,param,text",
    [
        ("top_p must be in (0, 1], got 3", None, "top_p", "top_p must be in (0, 1], got 3"),
        (
            "max_new_tokens: prompt (5) + max_new_tokens (9) exceeds",
            {"max_new_tokens": "max_tokens"},
            "max_tokens",
            "max_tokens: prompt (5) + max_new_tokens (9) exceeds",
        ),
        ("logit_bias token id 9999 is out of range [0, 512)", None, "logit_bias", None),
        ("something went wrong", None, None, "something went wrong"),
    ],
)
def test_bad_request_names_the_field(message, renames, param, text):
    error = bad_request(ValueError(message), renames)
    assert error.status == 400 and error.param == param
    if text is not None:
        assert error.message == text


def test_validation_locations_become_params():
    assert _loc_to_param(("body", "messages", 0, "role")) == "messages[0].role"
    assert _loc_to_param(("body", "prompt", "list[int]", 0)) == "prompt[0]"
    assert _loc_to_param(("body", "stream")) == "stream"
    assert _loc_to_param(("body",)) is None
    assert _loc_to_param(("body", "priority", "constrained-int")) == "priority"


def test_requests_parse_openai_shapes():
    req = CompletionRequest.model_validate({"prompt": [[1, 2], [3]], "extra_body": {"top_k": 5, "n": 9}, "n": 2})
    assert req.prompt == [[1, 2], [3]] and req.top_k == 5 and req.n == 2  # top level wins over extra_body
    params = req.sampling_params(max_tokens=7)
    assert params["max_new_tokens"] == 7 and params["top_k"] == 5 and "temperature" not in params
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompt == [1, 2]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompt == ["a", "b"]
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "stop": "END", "stream_options": {"include_usage": True}}
    )
    assert chat.sampling_params(3)["stop"] == "END" and chat.include_usage and not chat.continuous_usage


def test_token_bytes_rebuild_multibyte_text(tiny_tokenizer):
    texts = TokenTexts(tiny_tokenizer)
    text = "你好 🚀 bytes"
    ids = tiny_tokenizer.encode(text)
    assert b"".join(texts.bytes(i) for i in ids).decode() == text
    assert any(texts.text(i) == "\ufffd" for i in ids)  # pieces of characters read as replacement chars
    pairs = [(None, ids[0])] + [(-1.0, i) for i in ids[1:]]
    logprobs, end = completion_logprobs(texts, pairs, [None] + [[(-0.5, ids[1])]] * (len(ids) - 1), 0)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[0] == 0 and end == sum(len(t) for t in logprobs.tokens)


def test_chat_template_from_tokenizer_and_override(tiny_tokenizer, tmp_path):
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        }
    )
    own = ChatTemplate(tiny_tokenizer).render(req)
    assert own.startswith("<|im_start|>system\nbe brief") and "a\nb" in own
    assert own.endswith("<|im_start|>assistant\n")
    override = tmp_path / "template.jinja"
    override.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}>>")
    custom = ChatTemplate(tiny_tokenizer, str(override))
    assert custom.render(req) == "[system] be brief\n[user] a\nb\n>>"
    assert custom.encode(req) == tiny_tokenizer.encode("[system] be brief\n[user] a\nb\n>>", add_special_tokens=False)


def test_a_model_without_chat_template_gets_a_400(tiny_tokenizer):
    no_template = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None, encode=tiny_tokenizer.encode))
    serving = OpenAIServing(
        SimpleNamespace(tokenizer=tiny_tokenizer, context_length=1024),
        "m",
        ChatTemplate(no_template.tokenizer),
        ServedAdapters(False),
    )
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(APIError) as info:
        asyncio.run(serving.chat(req, request=None))
    assert info.value.status == 400 and "no chat template" in info.value.message
    assert "--chat-template" in info.value.message and info.value.param == "messages"


def test_metrics_registries_are_per_server():
    first, second = ServerMetrics("m"), ServerMetrics("m")  # no "Duplicated timeseries" clash
    first.record_first_token(0.01)
    first.record_admitted(0.02, prompt_tokens=10, cached_tokens=4)
    first.record_generated(3)
    first.record_finish(0.5, "stop")
    stats = {"num_running_reqs": 2, "num_queue_reqs": 1, "token_usage": 0.5, "cache_hit_rate": 0.4}
    first.update({"stats": {**stats, "num_retracted_reqs": 0}})
    samples = {s.name: s for f in text_string_to_metric_families(first.render().decode()) for s in f.samples}
    assert samples["radixserve:prompt_tokens_total"].value == 10
    assert samples["radixserve:num_running_reqs"].value == 2
    assert samples["radixserve:num_running_reqs"].labels == {"model_name": "m"}
    untouched = {s.name: s for f in text_string_to_metric_families(second.render().decode()) for s in f.samples}
    assert untouched["radixserve:prompt_tokens_total"].value == 0


def test_model_paths(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_path(ServerArgs(model_path=str(tmp_path)))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(ServerArgs(model_path=str(tmp_path))) == str(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        resolve_model_path(ServerArgs(model_path=str(tmp_path / "missing")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        resolve_model_path(ServerArgs(model_path="radixserve-tests/not-a-real-repo"))
    monkeypatch.setattr(demo_model, "demo_model_path", lambda: tmp_path / "demo")
    assert resolve_model_path(ServerArgs()) == str(tmp_path / "demo")


def test_model_path_at_hand_is_the_path_where_resolving_takes_no_time(tmp_path, monkeypatch):
    """What the CLI spawns the runtime for before it starts the HTTP server."""
    (tmp_path / "config.json").write_text("{}")
    assert model_path_at_hand(ServerArgs(model_path=str(tmp_path))) == str(tmp_path)
    assert model_path_at_hand(ServerArgs(model_path="radixserve-tests/not-a-real-repo")) is None  # a download first
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert model_path_at_hand(ServerArgs()) is None  # the demo model's first build
    built = tmp_path / "cache" / f"demo-model-{demo_model._VERSION}"
    built.mkdir(parents=True)
    assert model_path_at_hand(ServerArgs()) == str(built)


def test_demo_model_concurrent_first_runs_share_one_build(tmp_path, monkeypatch):
    """Two first runs at once: both build, one rename wins, both get the same
    complete directory, and no temporary directory is left behind."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_build(out_dir, **recipe):
        calls.append(recipe)
        time.sleep(0.2)  # both builders overlap
        Path(out_dir, "config.json").write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr("radixserve.checkpoints.random_model.build_llama_without_its_class", fake_build)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(demo_model.demo_model_path())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert (results[0] / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]
    assert calls and calls[0]["hidden_size"] == 256 and calls[0]["max_position_embeddings"] == 2048
    assert demo_model.demo_model_path() == results[0] and len(calls) <= 2  # cached from now on


def test_the_demo_model_is_what_build_tiny_model_writes_for_its_recipe(tmp_path):
    """The demo model is built without transformers' Llama class (a second less at its
    first start): the same names, shapes and values, config, generation config and
    tokenizer as the class-based build of the same recipe."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, GenerationConfig

    recipe = demo_model._RECIPE
    fast = build_llama_without_its_class(tmp_path / "fast", **recipe)
    reference = build_tiny_model(tmp_path / "reference", "llama", **recipe)
    assert sorted(p.name for p in fast.iterdir()) == sorted(p.name for p in reference.iterdir())
    ours, theirs = load_file(fast / "model.safetensors"), load_file(reference / "model.safetensors")
    assert ours.keys() == theirs.keys() and len(ours) == 3 + 9 * recipe["num_layers"]
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    configs = [AutoConfig.from_pretrained(path).to_dict() for path in (fast, reference)]
    for config in configs:
        del config["_name_or_path"]  # where it was read from
    assert configs[0] == configs[1]
    assert GenerationConfig.from_pretrained(fast).to_dict() == GenerationConfig.from_pretrained(reference).to_dict()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (fast / name).read_bytes() == (reference / name).read_bytes(), name


# ---- the OpenAI and native layers over a stand-in TokenizerManager -------------------------------
class FakeTokenizerManager:
    """Records the GenerateInputs it is given and answers each prompt with one
    finished choice (" done"), with prompt logprobs when asked for them."""

    context_length, kv_pool_tokens, page_size = 1024, 4096, 1

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.inputs = []

    def tokenize(self, text):
        return self.tokenizer.encode(text)

    def prepare(self, inp):
        ids = inp.input_ids if inp.input_ids is not None else self.tokenize(inp.text)
        return PreparedInput(inp, ids, SamplingParams.from_dict(inp.sampling_params))

    async def generate(self, prepared):
        inp, ids = prepared.obj, prepared.input_ids
        self.inputs.append(inp)
        out_ids = self.tokenizer.encode(" done", add_special_tokens=False)
        meta = {
            "id": inp.rid,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out_ids),
            "cached_tokens": 0,
            "finish_reason": FinishReason("length"),
            "output_token_logprobs": [(-0.5, t) for t in out_ids],
            "output_top_logprobs": [[] for _ in out_ids],
        }
        if inp.return_logprob and inp.logprob_start_len == 0:
            meta["input_token_logprobs"] = [(None, ids[0])] + [(-1.0, t) for t in ids[1:]]
            meta["input_top_logprobs"] = [None] + [[] for _ in ids[1:]]
        yield {
            "index": 0,
            "text": self.tokenizer.decode(out_ids),
            "output_ids": out_ids,
            "meta_info": meta,
            "finished": True,
        }


class ConnectedClient:
    """A Request whose client never disconnects."""

    async def receive(self):
        await asyncio.Event().wait()


def _answer(coro):
    """Run an endpoint; a streamed answer becomes its list of SSE payloads."""

    async def run():
        response = await coro
        if not hasattr(response, "body_iterator"):
            return response
        events = [event async for event in response.body_iterator]
        assert events[-1] == "data: [DONE]\n\n"
        return [json.loads(e[len("data: ") :]) for e in events[:-1]]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def bos_tokenizer(tiny_llama_dir):
    """The tiny tokenizer made to prepend its BOS on encode, as Llama's and Mistral's do."""
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    bos = tok.convert_tokens_to_ids("<|startoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A", special_tokens=[("<|startoftext|>", bos)]
    )
    assert tok.encode("x")[0] == bos
    return tok


def _assert_offsets_match(text, logprobs):
    assert logprobs.text_offset[0] == 0
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=False):
        assert text[offset : offset + len(token)] == token, (text, logprobs)
    assert "".join(logprobs.tokens) == text


def test_echo_returns_the_prompt_as_given(bos_tokenizer):
    tm = FakeTokenizerManager(bos_tokenizer)
    serving = OpenAIServing(tm, "m", ChatTemplate(bos_tokenizer), ServedAdapters(False))
    prompt_ids = bos_tokenizer.encode("echo me")
    req = CompletionRequest.model_validate({"prompt": "echo me", "echo": True, "logprobs": 1, "max_tokens": 3})
    choice = _answer(serving.completions(req, ConnectedClient())).choices[0]
    assert choice.text == "echo me done"  # no "<|startoftext|>" in front
    # The echoed logprobs cover the echoed text: the BOS the tokenizer added is not in it.
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) - 1 + len(bos_tokenizer.encode(" done", add_special_tokens=False))
    assert lp.token_logprobs[0] == -1.0  # the first prompt token, predicted from the BOS
    _assert_offsets_match(choice.text, lp)

    chunks = _answer(serving.completions(req.model_copy(update={"stream": True}), ConnectedClient()))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "echo me done"
    streamed = chunks[0]["choices"][0]["logprobs"]
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset

    # Token ids are echoed as given: every id, special ones included, decoded.
    req = CompletionRequest.model_validate({"prompt": prompt_ids, "echo": True, "logprobs": 0, "max_tokens": 3})
    choice = _answer(serving.completions(req, ConnectedClient())).choices[0]
    assert choice.text == "<|startoftext|>echo me done"
    done = bos_tokenizer.encode(" done", add_special_tokens=False)
    assert len(choice.logprobs.tokens) == len(prompt_ids) + len(done) and choice.logprobs.token_logprobs[0] is None
    _assert_offsets_match(choice.text, choice.logprobs)


def test_priority_reaches_the_runtime(tiny_tokenizer):
    tm = FakeTokenizerManager(tiny_tokenizer)
    serving = OpenAIServing(tm, "m", ChatTemplate(tiny_tokenizer), ServedAdapters(False))
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "priority": 3})
    _answer(serving.chat(chat, ConnectedClient()))
    completion = CompletionRequest.model_validate({"prompt": ["a", "b"], "extra_body": {"priority": -2}})
    _answer(serving.completions(completion, ConnectedClient()))
    _answer(serving.completions(CompletionRequest.model_validate({"prompt": "a"}), ConnectedClient()))
    assert [inp.priority for inp in tm.inputs] == [3, -2, -2, 0]

    tm.inputs.clear()
    body = GenerateRequestBody.model_validate({"text": ["a", "b"], "priority": [5, 1]})
    _answer(native_serving.generate(tm, body, ConnectedClient(), NO_LORA, "m"))
    _answer(native_serving.generate(tm, GenerateRequestBody(text="a", priority=7), ConnectedClient(), NO_LORA, "m"))
    assert [inp.priority for inp in tm.inputs] == [5, 1, 7]
    with pytest.raises(APIError) as info:
        _answer(
            native_serving.generate(
                tm, GenerateRequestBody(text=["a", "b"], priority=[1]), ConnectedClient(), NO_LORA, "m"
            )
        )
    assert info.value.status == 400 and info.value.param == "priority"


NO_LORA = ServedAdapters(False)


def test_adapter_names_reach_the_runtime(tiny_tokenizer):
    """A LoRA adapter named by ``model`` (alone or as BASE:ADAPTER) or ``lora_path``
    reaches the runtime by name; what is not loaded is refused naming its field."""
    tm = FakeTokenizerManager(tiny_tokenizer)
    serving = OpenAIServing(tm, "m", ChatTemplate(tiny_tokenizer), ServedAdapters(True, {"sql": "/a/sql"}))
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "model": "sql"})
    assert _answer(serving.chat(chat, ConnectedClient())).model == "sql"
    for body in ({"model": "m:sql"}, {"extra_body": {"lora_path": "sql"}}, {"model": "m"}, {}):
        _answer(serving.completions(CompletionRequest.model_validate({"prompt": "a", **body}), ConnectedClient()))
    adapters = ServedAdapters(True, {"sql": "/a/sql"})
    body = GenerateRequestBody.model_validate({"text": ["a", "b"], "lora_path": ["sql", None]})
    _answer(native_serving.generate(tm, body, ConnectedClient(), adapters, "m"))
    assert [inp.lora_name for inp in tm.inputs] == ["sql", "sql", "sql", None, None, "sql", None]
    refusals = [
        (serving.completions, CompletionRequest.model_validate({"prompt": "a", "model": "chat"}), 404, "model"),
        (serving.completions, CompletionRequest.model_validate({"prompt": "a", "lora_path": "chat"}), 400, "lora_path"),
    ]
    for call, req, status, param in refusals:
        with pytest.raises(APIError) as info:
            _answer(call(req, ConnectedClient()))
        assert (info.value.status, info.value.param) == (status, param)
    with pytest.raises(APIError) as info:
        _answer(
            native_serving.generate(tm, GenerateRequestBody(text="a", lora_path="sql"), ConnectedClient(), NO_LORA, "m")
        )
    assert info.value.param == "lora_path" and "--enable-lora" in info.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_generate_rejects_an_empty_batch(tiny_tokenizer, stream):
    # (Empty input_ids prompts, [] or [[]], are the TokenizerManager's 400: see test_server_api.)
    tm = FakeTokenizerManager(tiny_tokenizer)
    with pytest.raises(APIError) as info:
        _answer(
            native_serving.generate(tm, GenerateRequestBody(text=[], stream=stream), ConnectedClient(), NO_LORA, "m")
        )
    assert info.value.status == 400 and info.value.param == "text" and "empty" in info.value.message
    assert tm.inputs == []


# ---- front-door validation (the server-level cases are in test_hostile_inputs.py) -----------------
def test_lone_surrogates_and_deep_nesting_are_found_by_path():
    lone = "\udc00"
    assert find_bad_json({"messages": [{"role": "user", "content": "ok 😀"}], "stop": ["a"]}) is None
    path, problem = find_bad_json({"messages": [{"content": "ok"}, {"content": [{"text": lone}]}]})
    assert path == "messages[1].content[0].text" and "lone UTF-16 surrogate" in problem
    assert find_bad_json({"stop": ["a", "b", "c" + lone]})[0] == "stop[2]"
    assert find_bad_json({"chat_template_kwargs": {"k" + lone: 1}})[0] == "chat_template_kwargs"
    assert find_bad_json({"\ud800": 1})[0] == ""  # a top-level key: the body itself
    assert find_bad_json(5) is None
    assert find_bad_json("\U0001f600") is None  # a proper pair, as json.loads builds it from "\\ud83d\\ude00"
    deep: object = "x"
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    assert find_bad_json({"a": deep[0]}) is None  # exactly the limit
    path, problem = find_bad_json({"a": deep})
    assert path == "a" + "[0]" * (MAX_JSON_DEPTH - 1) and "nested deeper" in problem
    for _ in range(100_000):  # far deeper than the stack could recurse
        deep = {"k": deep}
    assert find_bad_json(deep)[0].count(".k") == MAX_JSON_DEPTH - 1


def _summary(model, data: dict) -> tuple:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return validation_summary(info.value.errors())


def test_validation_errors_name_the_most_specific_field():
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    param, message = _summary(ChatCompletionRequest, chat)
    assert param == "messages[0].content[0].type" and "'image_url'" in message
    # No member of the prompt's union takes [true]: the messages of all that were tried there are joined.
    param, message = _summary(CompletionRequest, {"prompt": [True]})
    assert param == "prompt[0]" and "valid integer" in message and "valid string" in message
    assert _summary(CompletionRequest, {"prompt": "x", "stop": ["a", "\udc00"]})[0] == "stop[1]"
    assert (
        _summary(
            ChatCompletionRequest,
            {**chat, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
        )[0]
        == "response_format"
    )
    assert validation_summary([]) == (None, "invalid request")


def test_strict_types_keep_harmless_coercions():
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "n": None, "stream": None})
    assert req.temperature == 1.0 and req.n == 1 and req.stream is False  # OpenAI's nulls mean "unset"
    for field, value in [("n", "2"), ("n", 2.0), ("echo", "yes"), ("max_tokens", True), ("seed", 2**64)]:
        assert _summary(CompletionRequest, {"prompt": "x", field: value})[0] == field


def test_undefined_fields_are_ignored_with_a_debug_line(caplog):
    with caplog.at_level(logging.DEBUG, logger="radixserve.server.protocol"):
        req = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "brand_new_option": 1, "user": "u"}
        )
    assert req.user == "u"
    assert "brand_new_option" in caplog.text and "'user'" not in caplog.text


def test_sampling_limits_come_from_the_flags():
    args = ServerArgs(max_n=4, max_stop_strings=2, max_stop_chars=10)
    SamplingParams(n=4, stop=["abcde", "fghij"]).validate(512, args)
    SamplingParams(n=1000, stop=["x"] * 100).validate(512)  # no limits given: none applied
    for params, text in [
        (SamplingParams(n=5), "n must be <= 4"),
        (SamplingParams(stop=["a", "b", "c"]), "stop must hold at most 2 strings"),
        (SamplingParams(stop=["abcdef", "ghijk"]), "stop must total at most 10 characters"),
        (SamplingParams(stop="x\udc00"), "stop must be valid Unicode"),
        (SamplingParams(top_k=2**63), "top_k must fit in 64 bits"),
    ]:
        with pytest.raises(ValueError, match=text):
            params.validate(512, args)
    defaults = ServerArgs()
    assert (defaults.max_n, defaults.max_stop_strings, defaults.max_stop_chars) == (64, 64, 8192)


class _TextEvent(BaseModel):
    text: str


def test_sse_events_survive_line_splitting_clients():
    """httpx's ``aiter_lines`` and requests' ``iter_lines`` split as
    ``str.splitlines`` does; a generated U+2028, U+2029 or U+0085 must not cut
    an event in two."""
    text = "a\u2028b\u2029c\x85d\ne"
    lines = [line for line in sse(_TextEvent(text=text)).splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == {"text": text}
