"""Hostile requests against one real server: every refusal is a 4xx in the
OpenAI envelope naming the field at fault, nothing is a 5xx or hangs, and the
server keeps serving (health, a normal chat, no request left running, the KV
pool invariant holding).

Bodies are sent as raw bytes (``json.dumps``, ASCII-escaped), since a lone
surrogate or NaN cannot go through a client's own JSON encoder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers_pool import ServerPool, assert_whole_pool_back
from helpers_server import ServerProcess, SharedServer
from helpers_shared_servers import MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS

S = "\udc00"  # a lone UTF-16 surrogate: valid JSON ("\udc00"), not valid Unicode text
LONG = "word " * 3000  # far beyond the tiny model's 1024-token context
HUGE = 10**30

CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "weather", "parameters": {"type": "object", "properties": {}}},
}


def chat(**kw: Any) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def msg(**fields: Any) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi", **fields}], "max_tokens": 2}


def content(value: Any) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": value}], "max_tokens": 2}


def cmpl(**kw: Any) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **kw}


def nest(levels: int) -> Any:
    """``{"a": {"a": ... "x"}}``, ``levels`` objects deep."""
    value: Any = "x"
    for _ in range(levels):
        value = {"a": value}
    return value


def gen(sampling: dict | None = None, **kw: Any) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2, **(sampling or {})}, **kw}


# (name, route, body (JSON-able) or raw bytes, expected status, expected param; None: no field to name)
CASES: list[tuple[str, str, dict | list | bytes, int, str | None]] = [
    # ---- transport and shape
    ("malformed_json", CHAT, b'{"messages": [', 400, None),
    ("not_utf8", CHAT, b'\xff\xfe{"a": 1}', 400, None),
    ("body_is_a_list", CHAT, [1, 2], 400, None),
    ("body_is_a_string", COMPLETIONS, "prompt", 400, None),
    ("empty_body", CHAT, b"", 400, None),
    ("nested_beyond_the_parser", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("int_of_5000_digits", COMPLETIONS, b'{"prompt": "hi", "n": 1' + b"0" * 5000 + b"}", 400, None),
    ("float_overflow", COMPLETIONS, b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e999}', 400, "temperature"),
    # Deeper than MAX_JSON_DEPTH (64): refused where it gets too deep, before any recursive code sees it.
    (
        "deep_chat_template_kwargs",
        CHAT,
        chat(chat_template_kwargs={"k": nest(100)}),
        400,
        "chat_template_kwargs.k" + ".a" * 62,
    ),
    ("deep_metadata", CHAT, chat(metadata=nest(100)), 400, "metadata" + ".a" * 63),
    ("deep_message_extra", CHAT, msg(extra=nest(100)), 400, "messages[0].extra" + ".a" * 61),
    ("deep_generate_stop", GENERATE, gen({"stop": nest(100)}), 400, "sampling_params.stop" + ".a" * 62),
    ("unknown_model_chat", CHAT, chat(model="gpt-9"), 404, "model"),
    ("unknown_model_completions", COMPLETIONS, cmpl(model="gpt-9"), 404, "model"),
    # ---- chat messages
    ("messages_missing", CHAT, {"model": "tiny"}, 400, "messages"),
    ("messages_null", CHAT, {"model": "tiny", "messages": None}, 400, "messages"),
    ("messages_empty", CHAT, chat(messages=[]), 400, "messages"),
    ("messages_a_string", CHAT, chat(messages="hi"), 400, "messages"),
    ("message_null", CHAT, chat(messages=[None]), 400, "messages[0]"),
    ("message_bad_role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    ("message_no_role", CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    ("content_an_int", CHAT, content(5), 400, "messages[0].content"),
    (
        "content_part_image",
        CHAT,
        content([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
        400,
        "messages[0].content[0].type",
    ),
    (
        "content_part_audio",
        CHAT,
        content([{"type": "text", "text": "a"}, {"type": "input_audio"}]),
        400,
        "messages[0].content[1].type",
    ),
    ("content_part_without_text", CHAT, content([{"type": "text"}]), 400, "messages[0].content[0]"),
    ("content_part_null", CHAT, content([None]), 400, "messages[0].content[0]"),
    ("continue_final_after_user", CHAT, chat(continue_final_message=True), 400, "continue_final_message"),
    ("chat_prompt_beyond_context", CHAT, content(LONG), 400, "messages"),
    ("chat_prompt_beyond_context_stream", CHAT, {**content(LONG), "stream": True}, 400, "messages"),
    # ---- lone surrogates in every text field
    ("surrogate_content", CHAT, content("hi" + S), 400, "messages[0].content"),
    ("surrogate_content_part", CHAT, content([{"type": "text", "text": S}]), 400, "messages[0].content[0].text"),
    (
        "surrogate_second_message",
        CHAT,
        chat(messages=[{"role": "system", "content": "a"}, {"role": "user", "content": S}]),
        400,
        "messages[1].content",
    ),
    ("surrogate_message_name", CHAT, msg(name=S), 400, "messages[0].name"),
    ("surrogate_message_extra_key", CHAT, msg(**{"x" + S: 1}), 400, "messages[0]"),
    ("surrogate_chat_stop", CHAT, chat(stop=S), 400, "stop"),
    ("surrogate_chat_stop_list", CHAT, chat(stop=["a", "b", "c" + S]), 400, "stop[2]"),
    ("surrogate_chat_stop_extra_body", CHAT, chat(extra_body={"stop": S}), 400, "stop"),
    (
        "surrogate_tools",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "description": S}}], tool_choice="none"),
        400,
        "tools[0].function.description",
    ),
    ("surrogate_chat_template_kwargs", CHAT, chat(chat_template_kwargs={"x": S}), 400, "chat_template_kwargs.x"),
    ("surrogate_user", CHAT, chat(user=S), 400, "user"),
    ("surrogate_prompt", COMPLETIONS, cmpl(prompt=S), 400, "prompt"),
    ("surrogate_prompt_list", COMPLETIONS, cmpl(prompt=["ok", "x" + S]), 400, "prompt[1]"),
    ("surrogate_completion_stop", COMPLETIONS, cmpl(stop=S), 400, "stop"),
    ("surrogate_generate_text", GENERATE, {"text": S}, 400, "text"),
    ("surrogate_generate_text_list", GENERATE, {"text": [S, "ok"]}, 400, "text[0]"),
    ("surrogate_generate_stop", GENERATE, gen({"stop": S}), 400, "sampling_params.stop"),
    ("surrogate_generate_stop_list", GENERATE, gen({"stop": ["a", S]}), 400, "sampling_params.stop[1]"),
    ("surrogate_rid", GENERATE, gen(rid="r" + S), 400, "rid"),
    ("surrogate_rid_list", GENERATE, {"text": ["a", "b"], "rid": ["a", S]}, 400, "rid[1]"),
    ("surrogate_tokenize", "/tokenize", {"prompt": S}, 400, "prompt"),
    ("surrogate_tokenize_list", "/tokenize", {"prompt": ["a", S]}, 400, "prompt[1]"),
    ("surrogate_abort_rid", "/abort_request", {"rid": S}, 400, "rid"),
    # ---- n and stop limits
    ("n_beyond_cap", CHAT, chat(n=MAX_N + 1), 400, "n"),
    ("n_huge", COMPLETIONS, cmpl(n=HUGE), 400, "n"),
    ("n_zero", CHAT, chat(n=0), 400, "n"),
    ("n_negative", COMPLETIONS, cmpl(n=-3), 400, "n"),
    ("n_string", CHAT, chat(n="5"), 400, "n"),
    ("n_float", CHAT, chat(n=1.5), 400, "n"),
    ("n_true", CHAT, chat(n=True), 400, "n"),
    ("generate_n_beyond_cap", GENERATE, gen({"n": MAX_N + 1}), 400, "sampling_params.n"),
    ("too_many_stop_strings", CHAT, chat(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), 400, "stop"),
    ("stop_strings_too_long", COMPLETIONS, cmpl(stop=["x" * (MAX_STOP_CHARS + 1)]), 400, "stop"),
    (
        "generate_too_many_stop_strings",
        GENERATE,
        gen({"stop": ["a"] * (MAX_STOP_STRINGS + 1)}),
        400,
        "sampling_params.stop",
    ),
    (
        "generate_stop_too_long",
        GENERATE,
        gen({"stop": ["y" * (MAX_STOP_CHARS // 2 + 1)] * 2}),
        400,
        "sampling_params.stop",
    ),
    ("ten_thousand_stop_strings", COMPLETIONS, cmpl(stop=["x" * 100] * 10_000), 400, "stop"),
    ("stop_empty_string", COMPLETIONS, cmpl(stop=""), 400, "stop"),
    ("stop_list_of_ints", CHAT, chat(stop=[1, 2]), 400, "stop[0]"),
    # ---- unimplemented OpenAI options
    ("response_format_unknown_type", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format"),
    (
        "response_format_json_schema_missing",
        CHAT,
        chat(response_format={"type": "json_schema"}),
        400,
        "response_format",
    ),
    ("response_format_a_string", CHAT, chat(response_format="json"), 400, "response_format"),
    (
        "tool_choice_names_an_unknown_function",
        CHAT,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
        400,
        "tool_choice",
    ),
    ("tool_choice_required_without_tools", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("tool_choice_bogus", CHAT, chat(tool_choice="sometimes"), 400, "tool_choice"),
    ("tools_not_a_list", CHAT, chat(tools={"type": "function"}, tool_choice="none"), 400, "tools"),
    ("tools_entry_a_string", CHAT, chat(tools=["get_weather"], tool_choice="none"), 400, "tools[0]"),
    (
        "tools_wrong_type",
        CHAT,
        chat(tools=[{"type": "retrieval", "function": {"name": "f"}}], tool_choice="none"),
        400,
        "tools[0].type",
    ),
    ("tools_no_function", CHAT, chat(tools=[{"type": "function"}], tool_choice="none"), 400, "tools[0].function"),
    (
        "tools_no_name",
        CHAT,
        chat(tools=[{"type": "function", "function": {"description": "d"}}], tool_choice="none"),
        400,
        "tools[0].function.name",
    ),
    (
        "tools_empty_name",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": ""}}], tool_choice="none"),
        400,
        "tools[0].function.name",
    ),
    ("functions", CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    ("function_call_named", CHAT, chat(function_call={"name": "f"}), 400, "function_call"),
    ("audio", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    ("modalities_audio", CHAT, chat(modalities=["text", "audio"]), 400, "modalities"),
    ("reasoning_effort", CHAT, chat(reasoning_effort="high"), 400, "reasoning_effort"),
    ("web_search_options", CHAT, chat(web_search_options={}), 400, "web_search_options"),
    ("echo_on_chat", CHAT, chat(echo=True), 400, "echo"),
    ("two_constraints", CHAT, chat(extra_body={"guided_json": {"type": "object"}, "regex": "a"}), 400, "regex"),
    ("guided_choice_a_string", COMPLETIONS, cmpl(guided_choice="[a-z]+"), 400, "guided_choice"),
    ("structured_outputs_unknown_key", COMPLETIONS, cmpl(structured_outputs={"yaml": "x"}), 400, "structured_outputs"),
    ("best_of_beyond_n", COMPLETIONS, cmpl(best_of=3), 400, "best_of"),
    ("suffix", COMPLETIONS, cmpl(suffix="end"), 400, "suffix"),
    # ---- coercions that change meaning, wrong types, odd numbers
    ("logprobs_yes_chat", CHAT, chat(logprobs="yes"), 400, "logprobs"),
    ("logprobs_int_chat", CHAT, chat(logprobs=1), 400, "logprobs"),
    ("top_logprobs_21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs_without_logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("logprobs_true_completions", COMPLETIONS, cmpl(logprobs=True), 400, "logprobs"),
    ("logprobs_21_completions", COMPLETIONS, cmpl(logprobs=21), 400, "logprobs"),
    ("stream_yes", CHAT, chat(stream="yes"), 400, "stream"),
    ("stream_one", COMPLETIONS, cmpl(stream=1), 400, "stream"),
    ("echo_yes", COMPLETIONS, cmpl(echo="yes"), 400, "echo"),
    ("ignore_eos_string", CHAT, chat(ignore_eos="true"), 400, "ignore_eos"),
    ("stream_options_without_stream", COMPLETIONS, cmpl(stream_options={"include_usage": True}), 400, "stream_options"),
    (
        "stream_options_nested_null",
        CHAT,
        chat(stream=True, stream_options={"include_usage": None}),
        400,
        "stream_options.include_usage",
    ),
    ("max_tokens_float", CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    ("max_tokens_string", COMPLETIONS, cmpl(max_tokens="5"), 400, "max_tokens"),
    ("max_tokens_negative", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens_huge", CHAT, chat(max_tokens=HUGE), 400, "max_tokens"),
    ("max_tokens_beyond_context", COMPLETIONS, cmpl(max_tokens=5000), 400, "max_tokens"),
    ("max_tokens_beyond_context_stream", COMPLETIONS, cmpl(max_tokens=5000, stream=True), 400, "max_tokens"),
    ("max_completion_tokens_true", CHAT, chat(max_completion_tokens=True), 400, "max_completion_tokens"),
    ("min_tokens_above_max", CHAT, chat(min_tokens=5), 400, "min_tokens"),
    ("temperature_nan", CHAT, chat(temperature=float("nan")), 400, "temperature"),
    ("temperature_infinity", COMPLETIONS, cmpl(temperature=float("inf")), 400, "temperature"),
    ("temperature_negative", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature_string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature_true", CHAT, chat(temperature=True), 400, "temperature"),
    ("top_p_zero", COMPLETIONS, cmpl(top_p=0), 400, "top_p"),
    ("top_p_huge_float", CHAT, chat(top_p=1e308), 400, "top_p"),
    ("top_k_zero", CHAT, chat(top_k=0), 400, "top_k"),
    ("top_k_huge", CHAT, chat(top_k=HUGE), 400, "top_k"),
    ("min_p_nan", COMPLETIONS, cmpl(min_p=float("nan")), 400, "min_p"),
    ("repetition_penalty_zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("frequency_penalty_3", CHAT, chat(frequency_penalty=3), 400, "frequency_penalty"),
    ("presence_penalty_neg_inf", CHAT, chat(presence_penalty=float("-inf")), 400, "presence_penalty"),
    ("seed_string", CHAT, chat(seed="42"), 400, "seed"),
    ("seed_float", COMPLETIONS, cmpl(seed=4.2), 400, "seed"),
    ("seed_huge", CHAT, chat(seed=HUGE), 400, "seed"),
    ("priority_true", COMPLETIONS, cmpl(priority=True), 400, "priority"),
    ("priority_huge", CHAT, chat(priority=HUGE), 400, "priority"),
    ("logit_bias_non_numeric_key", CHAT, chat(logit_bias={"hello": 5}), 400, "logit_bias"),
    ("logit_bias_key_true", COMPLETIONS, cmpl(logit_bias={"true": 5}), 400, "logit_bias"),
    ("logit_bias_value_string", CHAT, chat(logit_bias={"5": "high"}), 400, "logit_bias.5"),
    ("logit_bias_value_huge", CHAT, chat(logit_bias={"5": 1000}), 400, "logit_bias"),
    ("logit_bias_negative_key", CHAT, chat(logit_bias={"-1": 1}), 400, "logit_bias"),
    ("logit_bias_a_list", CHAT, chat(logit_bias=[1, 2]), 400, "logit_bias"),
    ("stop_token_ids_bools", CHAT, chat(stop_token_ids=[True, False]), 400, "stop_token_ids[0]"),
    ("stop_token_ids_out_of_vocab", CHAT, chat(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("chat_template_kwargs_a_list", CHAT, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("chat_template_kwargs_clash", CHAT, chat(chat_template_kwargs={"tokenize": True}), 400, "chat_template_kwargs"),
    # ---- completions prompts
    ("prompt_missing", COMPLETIONS, {"model": "tiny"}, 400, "prompt"),
    ("prompt_null", COMPLETIONS, cmpl(prompt=None), 400, "prompt"),
    ("prompt_empty_list", COMPLETIONS, cmpl(prompt=[]), 400, "prompt"),
    ("prompt_empty_string", COMPLETIONS, cmpl(prompt=""), 400, "prompt"),
    ("prompt_bool_token_ids", COMPLETIONS, cmpl(prompt=[True, False]), 400, "prompt[0]"),
    ("prompt_nested_bool_token_id", COMPLETIONS, cmpl(prompt=[[1, True]]), 400, "prompt[0][1]"),
    ("prompt_negative_token_id", COMPLETIONS, cmpl(prompt=[-1]), 400, "prompt"),
    ("prompt_huge_token_id", COMPLETIONS, cmpl(prompt=[HUGE]), 400, "prompt[0]"),
    ("prompt_float_token_ids", COMPLETIONS, cmpl(prompt=[1.5, 2.0]), 400, "prompt[0]"),
    ("prompt_an_object", COMPLETIONS, cmpl(prompt={"text": "x"}), 400, "prompt"),
    ("prompt_beyond_context", COMPLETIONS, cmpl(prompt=LONG), 400, "prompt"),
    # ---- native API
    ("generate_no_prompt", GENERATE, {"sampling_params": {}}, 400, "text"),
    ("generate_text_and_ids", GENERATE, {"text": "a", "input_ids": [1]}, 400, "text"),
    ("generate_bool_input_ids", GENERATE, {"input_ids": [True, False]}, 400, "input_ids[0]"),
    ("generate_nested_bool_input_ids", GENERATE, {"input_ids": [[1], [True]]}, 400, "input_ids[1][0]"),
    ("generate_empty_ids", GENERATE, {"input_ids": [[]]}, 400, "input_ids"),
    ("generate_unknown_sampling_param", GENERATE, gen({"bogus": 1}), 400, "sampling_params"),
    ("generate_sampling_params_a_string", GENERATE, {"text": "a", "sampling_params": "greedy"}, 400, "sampling_params"),
    ("generate_stop_token_ids_bools", GENERATE, gen({"stop_token_ids": [True]}), 400, "sampling_params.stop_token_ids"),
    ("generate_max_new_tokens_float", GENERATE, gen({"max_new_tokens": 1.5}), 400, "sampling_params.max_new_tokens"),
    ("generate_max_new_tokens_string", GENERATE, gen({"max_new_tokens": "5"}), 400, "sampling_params.max_new_tokens"),
    ("generate_ignore_eos_yes", GENERATE, gen({"ignore_eos": "yes"}), 400, "sampling_params.ignore_eos"),
    ("generate_temperature_nan", GENERATE, gen({"temperature": float("nan")}), 400, "sampling_params.temperature"),
    ("generate_top_k_huge", GENERATE, gen({"top_k": HUGE}), 400, "sampling_params.top_k"),
    (
        "generate_max_new_tokens_beyond_context",
        GENERATE,
        gen({"max_new_tokens": 10**6}),
        400,
        "sampling_params.max_new_tokens",
    ),
    ("generate_stream_yes", GENERATE, gen(stream="yes"), 400, "stream"),
    ("generate_return_logprob_yes", GENERATE, gen(return_logprob="yes"), 400, "return_logprob"),
    ("generate_top_logprobs_num_negative", GENERATE, gen(top_logprobs_num=-1), 400, "top_logprobs_num"),
    ("generate_top_logprobs_num_string", GENERATE, gen(top_logprobs_num="3"), 400, "top_logprobs_num"),
    ("generate_logprob_start_len_negative", GENERATE, gen(logprob_start_len=-5), 400, "logprob_start_len"),
    ("generate_priority_list_mismatch", GENERATE, {"text": ["a", "b"], "priority": [1]}, 400, "priority"),
    ("generate_rid_an_int", GENERATE, gen(rid=5), 400, "rid"),
    # ---- tokenize / detokenize / abort
    ("tokenize_no_prompt", "/tokenize", {}, 400, "prompt"),
    (
        "tokenize_add_special_tokens_yes",
        "/tokenize",
        {"prompt": "a", "add_special_tokens": "yes"},
        400,
        "add_special_tokens",
    ),
    ("tokenize_unknown_model", "/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    ("detokenize_bool_tokens", "/detokenize", {"tokens": [True, False]}, 400, "tokens[0]"),
    ("detokenize_out_of_vocab", "/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("detokenize_huge_token", "/detokenize", {"tokens": [HUGE]}, 400, "tokens[0]"),
    ("detokenize_a_string", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("abort_no_rid", "/abort_request", {}, 400, "rid"),
]


@pytest.fixture(scope="module")
def server(guarded_servers: SharedServer) -> Iterator[ServerProcess]:
    """--max-n MAX_N, --max-stop-strings MAX_STOP_STRINGS, --max-stop-chars MAX_STOP_CHARS (shared with
    test_server_api.py, whose API key the module's ``http`` client sends: helpers_shared_servers)."""
    srv = guarded_servers.get()
    yield srv
    assert srv.proc.poll() is None, f"the server died:\n{srv.log}"


def send(http: httpx.Client, route: str, body: dict | list | str | bytes) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII: "\udc00", NaN, Infinity
    return http.post(route, content=raw, headers={"content-type": "application/json"})


def test_cases_are_unique_and_enough():
    names = [case[0] for case in CASES]
    assert len(names) == len(set(names)) and len(names) >= 60


@pytest.mark.parametrize("name,route,body,status,param", CASES, ids=[case[0] for case in CASES])
def test_hostile_request_is_refused_by_name(http, name, route, body, status, param):
    response = send(http, route, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["param"] == param, error


# Accepted: options that are no-ops here, nulls meaning "unset", fields the API does not define.
ACCEPTED = [
    ("tools_with_tool_choice_none", CHAT, chat(tools=[TOOL], tool_choice="none", parallel_tool_calls=False)),
    ("response_format_text", CHAT, chat(response_format={"type": "text"})),
    (
        "no_op_fields",
        CHAT,
        chat(
            user="u1",
            store=False,
            metadata={"k": "v"},
            service_tier="auto",
            prediction={"type": "content", "content": "x"},
            modalities=["text"],
        ),
    ),
    ("nulls_mean_unset", CHAT, chat(n=None, stream=None, logprobs=None, temperature=None, stop=None, seed=None)),
    ("unknown_fields_ignored", CHAT, chat(some_future_option={"x": 1})),
    ("best_of_equal_to_n", COMPLETIONS, cmpl(best_of=2, n=2)),
    ("int_where_float_expected", COMPLETIONS, cmpl(temperature=1, top_p=1)),
    ("stop_at_the_limits", COMPLETIONS, cmpl(stop=["x" * (MAX_STOP_CHARS // MAX_STOP_STRINGS)] * MAX_STOP_STRINGS)),
    ("n_at_the_cap", GENERATE, gen({"n": MAX_N})),
    ("valid_non_ascii", CHAT, content("héllo 😀 世界")),
]


@pytest.mark.parametrize("name,route,body", ACCEPTED, ids=[case[0] for case in ACCEPTED])
def test_harmless_request_is_served(http, name, route, body):
    response = send(http, route, body)
    assert response.status_code == 200, response.text


def test_server_still_serves_after_every_case(server, http):
    """Runs after the cases above (pytest keeps file order)."""
    assert http.get("/health").status_code == 200
    answer = http.post(CHAT, json=chat(max_tokens=4))
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["role"] == "assistant"
    assert_whole_pool_back(ServerPool(server.url, server.auth_headers))
