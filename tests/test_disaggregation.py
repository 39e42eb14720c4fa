"""Prefill/decode disaggregation with real workers on 127.0.0.1: a prefill worker and a
decode worker given the same request with SGLang's bootstrap fields (as a gateway
sends it) answer, on the decode side, with the greedy tokens an ordinary worker gives,
streamed or not, with logprobs, between workers of different page sizes; the KV went
through the built-in tcp backend, and both pools are whole afterwards. The same pair
serves behind SGLang's gateway (smg 1.13 in its PD mode) and behind our router, which
routes around a dead prefill worker. A room that never gets its KV ends with a 502
saying why, freeing its pages."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers_mooncake import MOONCAKE
from helpers_pool import ServerPool, assert_whole_pool_back, idle
from helpers_server import ServerProcess, wait_until
from helpers_smg import NOT_INSTALLED, SMG_COMMANDS, SMG_TIMEOUT_S, free_port, smg

from radixserve.checkpoints.random_adapter import build_random_adapter

COMMON = ("--served-model-name", "tiny", "--max-total-tokens", "4096", "--skip-server-warmup")


@pytest.fixture(scope="module")
def workers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    bootstrap_port = free_port()
    # Each worker serves one LoRA adapter (docs/lora.md): a pair computes its KV under it on both sides.
    adapter = build_random_adapter(tiny_llama_dir, tmp_path_factory.mktemp("adapter"), rank=8, seed=3)
    model = ("--model", str(tiny_llama_dir), *COMMON, "--enable-lora", "--lora-paths", f"sql={adapter}")
    prefill = ServerProcess(
        *model,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(bootstrap_port),
        "--disaggregation-timeout-secs",
        "4",
    )
    # The decode side's pages are 16 tokens, the prefill side's 1 (the default): the KV is
    # addressed by token slot, so the pair converts.
    decode = ServerProcess(
        *model, "--disaggregation-mode", "decode", "--disaggregation-timeout-secs", "6", "--page-size", "16"
    )
    plain = ServerProcess(*model)
    servers = (prefill, decode, plain)
    try:
        for server in servers:
            server.wait_ready()
        yield {"prefill": prefill, "decode": decode, "plain": plain, "bootstrap_port": bootstrap_port}
    finally:
        for server in servers:
            server.stop()


def _paired(workers: dict[str, Any], path: str, body: dict[str, Any], room: int) -> tuple[httpx.Response, str]:
    """Send ``body`` to both workers at once, as a gateway does; the prefill worker's
    response and the decode worker's (its text when streamed)."""
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": workers["bootstrap_port"], "bootstrap_room": room}
    paired = {**body, **fields}

    def decode() -> str:
        if not body.get("stream"):
            answer = httpx.post(workers["decode"].url + path, json=paired, timeout=120)
            assert answer.status_code == 200, answer.text
            return answer.text
        with httpx.stream("POST", workers["decode"].url + path, json=paired, timeout=120) as answer:
            assert answer.status_code == 200, answer.read()
            return "".join(answer.iter_text())

    with ThreadPoolExecutor(2) as pool:
        decoding = pool.submit(decode)
        prefilled = pool.submit(httpx.post, workers["prefill"].url + path, json=paired, timeout=120)
        return prefilled.result(), decoding.result()


def _streamed_text(events: str) -> str:
    chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def test_a_pair_gives_the_greedy_tokens_of_an_ordinary_worker(workers):
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = httpx.post(workers["plain"].url + "/v1/completions", json=body, timeout=120).json()
    prefilled, decoded = _paired(workers, "/v1/completions", body, room=11)
    assert prefilled.status_code == 200, prefilled.text
    answer = json.loads(decoded)
    assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == 24
    # The prefill worker answered with the first token alone.
    assert prefilled.json()["usage"]["completion_tokens"] == 1
    assert expected["choices"][0]["text"].startswith(prefilled.json()["choices"][0]["text"])

    _, streamed = _paired(workers, "/v1/completions", {**body, "stream": True}, room=12)
    assert _streamed_text(streamed) == expected["choices"][0]["text"]

    # Logprobs: the first token's come from the prefill side, the rest from the decode side.
    with_logprobs = {**body, "logprobs": 2}
    plain = httpx.post(workers["plain"].url + "/v1/completions", json=with_logprobs, timeout=120).json()
    _, paired = _paired(workers, "/v1/completions", with_logprobs, room=14)
    got, want = json.loads(paired)["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
    assert got["tokens"] == want["tokens"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-3)
    assert [sorted(t) for t in got["top_logprobs"]] == [sorted(t) for t in want["top_logprobs"]]

    # Twice: the second time the decode worker has the prompt cached (whole 16-token pages
    # of it), and only the rest of its KV comes.
    longer = {**body, "prompt": "the quick brown fox jumps over the lazy dog " * 6}
    expected_longer = httpx.post(workers["plain"].url + "/v1/completions", json=longer, timeout=120).json()
    for room, cached in ((17, False), (18, True)):
        _, decoded_longer = _paired(workers, "/v1/completions", longer, room=room)
        answer_longer = json.loads(decoded_longer)
        assert answer_longer["choices"][0]["text"] == expected_longer["choices"][0]["text"]
        assert (answer_longer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16) == cached

    # n > 1: each sample's KV has a room of its own, derived alike on both sides.
    _, two = _paired(workers, "/v1/completions", {**body, "n": 2}, room=16)
    assert [c["text"] for c in json.loads(two)["choices"]] == [expected["choices"][0]["text"]] * 2

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10, "temperature": 0}
    expected_chat = httpx.post(workers["plain"].url + "/v1/chat/completions", json=chat, timeout=120).json()
    _, decoded_chat = _paired(workers, "/v1/chat/completions", chat, room=15)
    want_chat = expected_chat["choices"][0]["message"]["content"]
    assert json.loads(decoded_chat)["choices"][0]["message"]["content"] == want_chat

    # Under a LoRA adapter: both sides compute under it, and the text is an ordinary worker's under it.
    adapted = {**body, "model": "sql"}
    expected_adapted = httpx.post(workers["plain"].url + "/v1/completions", json=adapted, timeout=120).json()
    assert expected_adapted["choices"][0]["text"] != expected["choices"][0]["text"]
    _, decoded_adapted = _paired(workers, "/v1/completions", adapted, room=19)
    assert json.loads(decoded_adapted)["choices"][0]["text"] == expected_adapted["choices"][0]["text"]

    native = {"text": "a longer prompt " * 20, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    expected_native = httpx.post(workers["plain"].url + "/generate", json=native, timeout=120).json()
    _, decoded_native = _paired(workers, "/generate", native, room=13)
    assert json.loads(decoded_native)["text"] == expected_native["text"]
    for side in ("prefill", "decode"):
        assert_whole_pool_back(ServerPool(workers[side].url))


def test_a_room_whose_kv_never_comes_ends_with_a_502_and_frees_its_pages(workers):
    body = {
        "model": "tiny",
        "prompt": "nobody prefills this",
        "max_tokens": 8,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": free_port(),  # no prefill worker there
        "bootstrap_room": 99,
    }
    answer = httpx.post(workers["decode"].url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 502, answer.text
    assert "prefill/decode transfer failed" in answer.json()["error"]["message"]
    assert_whole_pool_back(ServerPool(workers["decode"].url))
    # The worker goes on serving.
    plain = {k: v for k, v in body.items() if not k.startswith("bootstrap_")}
    ok = httpx.post(workers["decode"].url + "/v1/completions", json=plain, timeout=120)
    assert ok.status_code == 200, ok.text


def test_a_prefill_worker_whose_decode_worker_never_comes_frees_the_kv_at_its_timeout(workers):
    url = workers["prefill"].url
    body = {"model": "tiny", "prompt": "no decode worker asks for this", "max_tokens": 8, "temperature": 0}
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": workers["bootstrap_port"], "bootstrap_room": 88}
    answer = httpx.post(url + "/v1/completions", json={**body, **fields}, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 1, answer.text
    assert not idle(ServerPool(url).stats())  # its KV is held for the decode worker ...
    assert wait_until(lambda: idle(ServerPool(url).stats()), 10)  # ... until the 4 s timeout
    assert any("no decode worker registered room 88" in line for line in workers["prefill"].lines)
    assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_a_client_that_leaves_while_its_kv_is_awaited_frees_the_slots_at_once(workers):
    body = {"model": "tiny", "prompt": "a prompt whose KV never comes", "max_tokens": 8}
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 77}
    url = workers["decode"].url
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**body, **fields}, timeout=1)
    # Well before the 6 s the decode worker waits for KV: the abort freed the slots.
    assert wait_until(lambda: idle(ServerPool(url).stats()), 3), ServerPool(url).stats()
    assert_whole_pool_back(ServerPool(url))


def test_bootstrap_fields_come_together_and_pair_one_sequence(workers):
    url = workers["decode"].url + "/v1/completions"
    partial = httpx.post(url, json={"model": "tiny", "prompt": "x", "bootstrap_room": 5}, timeout=30)
    assert partial.status_code == 400 and partial.json()["error"]["param"] == "bootstrap_host"
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 5}
    many = httpx.post(url, json={"model": "tiny", "prompt": ["x", "y"], **fields}, timeout=30)
    assert many.status_code == 400 and many.json()["error"]["param"] == "bootstrap_room"
    assert_whole_pool_back(ServerPool(workers["decode"].url))


def test_a_pair_serves_structured_output_and_prompt_logprobs(workers):
    """The grammar constrains the prefill side's first token and the decode side's
    rest; the prompt's logprobs (echo) come from the prefill side's prompt pass."""
    constrained = {"model": "tiny", "prompt": "pick", "max_tokens": 12, "temperature": 0, "regex": "(ab|ba){2}c"}
    expected = httpx.post(workers["plain"].url + "/v1/completions", json=constrained, timeout=120).json()
    _, decoded = _paired(workers, "/v1/completions", constrained, room=41)
    text = json.loads(decoded)["choices"][0]["text"]
    assert text == expected["choices"][0]["text"] and re.fullmatch("(ab|ba){2}c", text), text

    echoed = {"model": "tiny", "prompt": "echo me back", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}
    plain = httpx.post(workers["plain"].url + "/v1/completions", json=echoed, timeout=120).json()
    _, paired = _paired(workers, "/v1/completions", echoed, room=42)
    got, want = json.loads(paired)["choices"][0], plain["choices"][0]
    assert got["text"] == want["text"]
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-3)
    for side in ("prefill", "decode"):
        assert_whole_pool_back(ServerPool(workers[side].url))


def _access(server: ServerProcess, path: str) -> list[str]:
    return [line for line in server.lines if f"POST {path} 200" in line]


def test_the_pair_serves_behind_smg_in_pd_mode(workers, tmp_path):
    command = SMG_COMMANDS["1.13"]
    if command is None:
        pytest.skip(NOT_INSTALLED.format(version="1.13"))
    prefill, decode = workers["prefill"], workers["decode"]
    args = ["--pd-disaggregation", "--prefill", prefill.url, str(workers["bootstrap_port"]), "--decode", decode.url]
    args += ["--prometheus-port", str(free_port())]
    body = {"model": "tiny", "prompt": "gateways pair the halves", "max_tokens": 16, "temperature": 0}
    expected = httpx.post(workers["plain"].url + "/v1/completions", json=body, timeout=120).json()
    seen = {side: len(_access(workers[side], "/v1/completions")) for side in ("prefill", "decode")}
    with smg(command, args, tmp_path / "smg.log") as gateway:

        def serves() -> bool:
            try:
                return httpx.get(gateway + "/v1/models", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(serves, SMG_TIMEOUT_S, 0.5), (tmp_path / "smg.log").read_text()[-3000:]
        answer = httpx.post(gateway + "/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected["choices"][0]["text"]
        with httpx.stream("POST", gateway + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            assert _streamed_text("".join(r.iter_text())) == expected["choices"][0]["text"]
    # smg sent each request to both: the prefill worker made the first token, the decode worker the rest.
    assert wait_until(lambda: len(_access(decode, "/v1/completions")) == seen["decode"] + 2, 10)
    new_prefill = _access(prefill, "/v1/completions")[seen["prefill"] :]
    assert len(new_prefill) == 2 and all(" completion=1 " in line for line in new_prefill), new_prefill
    for side in ("prefill", "decode"):
        assert_whole_pool_back(ServerPool(workers[side].url))


def test_our_router_pairs_them_and_retries_a_pair_whose_prefill_side_fails(workers, tiny_llama_dir):
    """``radixserve router --pd-disaggregation``: the client sees one worker's answer; a
    second prefill worker that dies is routed around (the try fails, the decode side's
    request is ended, another pair answers), and no KV stays held anywhere."""
    spare_port = free_port()
    model = ("--model", str(tiny_llama_dir), *COMMON)
    spare = ServerProcess(
        *model, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(spare_port)
    )
    with spare:
        spare.wait_ready()
        _route_around_a_dead_prefill_worker(workers, spare)
    for side in ("prefill", "decode"):
        assert_whole_pool_back(ServerPool(workers[side].url))


def _route_around_a_dead_prefill_worker(workers: dict[str, Any], spare: ServerProcess) -> None:
    prefill, decode = workers["prefill"], workers["decode"]
    flags = ["--pd-disaggregation", "--prefill", prefill.url, str(workers["bootstrap_port"])]
    flags += ["--prefill", spare.url, "--decode", decode.url, "--prefill-policy", "round_robin"]
    flags += ["--health-check-interval-secs", "0.5", "--retry-initial-backoff-ms", "10"]
    body = {"model": "tiny", "prompt": "routers pair the halves too", "max_tokens": 16, "temperature": 0}
    expected = httpx.post(workers["plain"].url + "/v1/completions", json=body, timeout=120).json()
    with ServerProcess(*flags, command="router") as router:
        router.wait_ready(60)
        # Ready means the workers named at start-up were asked; one busy then joins at a health check.
        assert wait_until(lambda: httpx.get(router.url + "/health").json()["workers"] == 3, 30)
        for _ in range(2):  # round robin: each prefill worker once
            answer = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == expected["choices"][0]["text"]
        with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            assert _streamed_text("".join(r.iter_text())) == expected["choices"][0]["text"]
        assert [line for line in _access(spare, "/v1/completions") if " completion=1 " in line]  # it served
        spare.stop()  # now every other pair's prefill side is gone
        for _ in range(3):
            answer = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == expected["choices"][0]["text"]


def test_pairs_of_different_tensor_parallel_degrees(workers, tiny_llama_dir):
    """tp 1 prefill to tp 2 decode (one sender, a receiver per rank given its heads), and
    tp 2 prefill to tp 1 decode (each rank sends its heads): the greedy tokens of an
    ordinary worker, and every pool whole afterwards."""
    model = ("--model", str(tiny_llama_dir), *COMMON, "--tp-size", "2")
    port = free_port()
    prefill_tp2 = ServerProcess(
        *model, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port)
    )
    decode_tp2 = ServerProcess(*model, "--disaggregation-mode", "decode", "--disaggregation-timeout-secs", "20")
    body = {"model": "tiny", "prompt": "ranks split the heads", "max_tokens": 16, "temperature": 0}
    expected = httpx.post(workers["plain"].url + "/v1/completions", json=body, timeout=120).json()
    with prefill_tp2, decode_tp2:
        prefill_tp2.wait_ready()
        decode_tp2.wait_ready()
        # A first request served whole on each (warm-up is skipped), so that a busy machine's
        # slow first step does not outlast the prefill side's 4 s hold on the KV.
        for server in (prefill_tp2, decode_tp2):
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
        combos = {
            "tp1 -> tp2": {**workers, "decode": decode_tp2},
            "tp2 -> tp1": {**workers, "prefill": prefill_tp2, "bootstrap_port": port},
        }
        for room, (name, pair) in enumerate(combos.items(), start=31):
            for stream in (False, True):
                _, decoded = _paired(pair, "/v1/completions", {**body, "stream": stream}, room=room * 2 + stream)
                text = _streamed_text(decoded) if stream else json.loads(decoded)["choices"][0]["text"]
                assert text == expected["choices"][0]["text"], name
        for server in (prefill_tp2, decode_tp2, workers["prefill"], workers["decode"]):
            assert_whole_pool_back(ServerPool(server.url))


@MOONCAKE
def test_a_pair_over_mooncake_gives_the_greedy_tokens_of_an_ordinary_worker(workers, tiny_llama_dir):
    """The same pair over Mooncake's transfer engine (its TCP transport here): the prefill
    worker's engine writes the KV into the decode worker's pool, whose pages are 16 tokens
    to the prefill side's 1; streamed or not, n > 1, a prompt the decode side has cached."""
    model = ("--model", str(tiny_llama_dir), *COMMON, "--disaggregation-transfer-backend", "mooncake")
    port = free_port()
    prefill = ServerProcess(*model, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port))
    decode = ServerProcess(*model, "--disaggregation-mode", "decode", "--page-size", "16")
    body = {"model": "tiny", "prompt": "over mooncake " * 5, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    expected = httpx.post(workers["plain"].url + "/v1/completions", json=body, timeout=120).json()
    want = expected["choices"][0]["text"]
    with prefill, decode:
        prefill.wait_ready()
        decode.wait_ready()
        pair = {"prefill": prefill, "decode": decode, "bootstrap_port": port}
        _, decoded = _paired(pair, "/v1/completions", body, room=41)
        assert json.loads(decoded)["choices"][0]["text"] == want
        _, streamed = _paired(pair, "/v1/completions", {**body, "stream": True}, room=42)
        assert _streamed_text(streamed) == want
        _, two = _paired(pair, "/v1/completions", {**body, "n": 2}, room=43)
        answer = json.loads(two)
        assert [c["text"] for c in answer["choices"]] == [want, want]
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # only the rest was written
        for server in (prefill, decode):
            assert_whole_pool_back(ServerPool(server.url))


def test_a_prefill_worker_killed_mid_run_loses_no_request(workers, tiny_llama_dir):
    """SIGKILL, with requests in flight through our router: each is retried on the
    surviving pair (before its first byte) and answers as an ordinary worker would; the
    survivors hold no KV afterwards."""
    port = free_port()
    model = ("--model", str(tiny_llama_dir), *COMMON)
    doomed = ServerProcess(*model, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port))
    bodies = [
        {"model": "tiny", "prompt": f"request {i} of a run", "max_tokens": 12, "temperature": 0} for i in range(24)
    ]
    expected = [
        httpx.post(workers["plain"].url + "/v1/completions", json=b, timeout=120).json()["choices"][0]["text"]
        for b in bodies
    ]
    with doomed:
        doomed.wait_ready()
        prefill, decode = workers["prefill"], workers["decode"]
        flags = ["--pd-disaggregation", "--prefill", prefill.url, str(workers["bootstrap_port"])]
        flags += ["--prefill", doomed.url, "--decode", decode.url, "--prefill-policy", "round_robin"]
        flags += ["--health-check-interval-secs", "0.5", "--retry-initial-backoff-ms", "10"]
        flags += ["--retry-max-retries", "5"]
        with ServerProcess(*flags, command="router") as router:
            router.wait_ready(60)
            with ThreadPoolExecutor(6) as pool:
                answers = [pool.submit(httpx.post, router.url + "/v1/completions", json=b, timeout=120) for b in bodies]
                assert wait_until(lambda: sum(a.done() for a in answers) >= 6, 60)
                doomed.proc.kill()
                texts = [a.result().json()["choices"][0]["text"] for a in answers]
            assert texts == expected
    for side in ("prefill", "decode"):
        assert_whole_pool_back(ServerPool(workers[side].url))


def test_a_decode_worker_killed_mid_stream_ends_the_stream_in_order(workers, tiny_llama_dir):
    """SIGKILL on the decode side while it streams through our router: the client's
    stream ends with an error event (no retry once bytes have gone out), and the
    prefill worker holds no KV afterwards."""
    model = ("--model", str(tiny_llama_dir), *COMMON)
    doomed = ServerProcess(*model, "--disaggregation-mode", "decode")
    with doomed:
        doomed.wait_ready()
        flags = ["--pd-disaggregation", "--prefill", workers["prefill"].url, str(workers["bootstrap_port"])]
        flags += ["--decode", doomed.url]
        body = {"model": "tiny", "prompt": "a long story", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with ServerProcess(*flags, command="router") as router:
            router.wait_ready(60)
            events = []
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    events.append(line)
                    if len(events) == 8:
                        doomed.proc.kill()
            data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
            assert data[-1].get("error") and "broke off" in data[-1]["error"]["message"], events[-3:]
            assert len([d for d in data if d.get("choices")]) < 1000
    assert_whole_pool_back(ServerPool(workers["prefill"].url))
