"""The worker side of a gateway: SGLang's worker endpoints (``/server_info``,
``/model_info``, ``/get_load``, ``/v1/loads``) with what a router needs under
``/server_info["worker"]``, the admin key, the profile directory, and the real
SGLang model gateway (``smg`` 0.3.2 and 1.13) fronting two radixserve workers."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers_server import ServerProcess, serving, wait_until
from helpers_smg import NOT_INSTALLED, SMG_COMMANDS, SMG_TIMEOUT_S, smg

from radixserve.config import ServerArgs
from radixserve.runtime.scheduling.stats import ServingTotals, StepRates
from radixserve.server.profile_dir import ProfileDir

USER_KEY = "user-key"
ADMIN_KEY = "admin-key"
USER = {"Authorization": f"Bearer {USER_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
WORKER_KEYS = {
    "device",
    "dtype",
    "backends",
    "tp_size",
    "dp_size",
    "context_length",
    "max_total_num_tokens",
    "max_running_requests",
    "prefill_step_tokens",
    "features",
    "decode_tokens_per_s",
    "prefill_tokens_per_s",
    "decode_bands",
    "prefill_bands",
    "speculative",
    "lora",
}
LOAD_KEYS = {
    "dp_rank",
    "num_reqs",
    "num_waiting_reqs",
    "num_tokens",
    "num_pending_tokens",
    "ts_tic",
    "num_running_reqs",
    "num_waiting_tokens",
    "num_used_tokens",
    "max_total_num_tokens",
    "decode_tokens_per_s",
    "prefill_tokens_per_s",
    "decode_bands",
    "prefill_bands",
}
V1_LOAD_KEYS = {
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_total_reqs",
    "num_used_tokens",
    "max_total_num_tokens",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "max_running_requests",
}
POOL = 32768
# What auto picks is not tested here: the highest-priority backend, no timing of each at the model's shapes.
PRIORITY = ("--backend-selection", "priority")
LONG = {"max_new_tokens": 20000, "ignore_eos": True}  # seconds of decoding: still running while the test looks


# ---- the parts, without a server ---------------------------------------------------------------


def _step(rates: StepRates, totals: ServingTotals, seconds: float, tokens: int, decode: bool = True) -> None:
    with rates.measure(totals):
        time.sleep(seconds)
        if decode:
            totals.generation_tokens += tokens
            totals.decode_steps += 1
        else:  # a prefill: its prompt tokens computed, and its first token sampled
            totals.count_extend(tokens)
            totals.generation_tokens += 1


def test_step_rates_count_the_last_window_of_their_kind_of_steps():
    rates, totals = StepRates(window_s=0.05), ServingTotals()
    assert rates.decode.tokens_per_s is None and rates.prefill.tokens_per_s is None
    _step(rates, totals, 0.01, 300, decode=False)  # the warm-up's prefill: no decode yet
    assert rates.decode.tokens_per_s is None
    assert 0 < rates.prefill.tokens_per_s <= 300 / 0.01
    _step(rates, totals, 0.06, 100)
    assert 0 < rates.decode.tokens_per_s <= 100 / 0.06
    _step(rates, totals, 0.06, 1)  # the first step is out of the window now
    assert 0 < rates.decode.tokens_per_s <= 1 / 0.06
    time.sleep(0.1)  # idle time does not count: the figures stay
    assert 0 < rates.decode.tokens_per_s <= 1 / 0.06 and rates.prefill.tokens_per_s > 0


def test_profile_dir_confines_output_dir(tmp_path):
    root = tmp_path / "profiles"
    (tmp_path / "outside").mkdir()
    root.mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    dirs = ProfileDir(str(root))
    assert dirs.resolve(None) == str(root) and dirs.resolve("runs/a") == str(root / "runs" / "a")
    assert dirs.resolve("runs/../b") == str(root / "b")
    for escape in (str(tmp_path / "outside"), "../outside", "runs/../../outside", "link", "link/x"):
        with pytest.raises(ValueError, match="^output_dir: "):
            dirs.resolve(escape)


def test_admin_key_must_differ_from_the_api_key():
    with pytest.raises(ValueError, match="^admin_api_key: "):
        ServerArgs(api_key="same", admin_api_key="same")


# ---- one worker with both keys and a profile directory -------------------------------------------


@pytest.fixture(scope="module")
def profile_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def server(long_llama_dir: Path, profile_root: Path) -> Iterator[ServerProcess]:
    with serving(
        long_llama_dir,
        "--api-key",
        USER_KEY,
        "--admin-api-key",
        ADMIN_KEY,
        "--profile-dir",
        str(profile_root),
        "--max-total-tokens",
        str(POOL),
        "--max-running-requests",
        "1",
        *PRIORITY,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=USER, timeout=120) as client:
        yield client


def _load(http: httpx.Client) -> dict[str, Any]:
    entries = http.get("/get_load").json()
    assert isinstance(entries, list) and len(entries) == 1, entries
    return entries[0]


def test_sglang_shapes_beside_the_old_names(http):
    info = http.get("/server_info").json()
    assert info.keys() == http.get("/get_server_info").json().keys()
    worker = info["worker"]
    assert set(worker) == WORKER_KEYS and worker["lora"] is None  # LoRA off
    assert worker["device"] == "cpu" and worker["dtype"] == info["dtype"] == "float32"
    assert worker["backends"] == info["backends"] and worker["backends"]["attention"]
    assert (worker["tp_size"], worker["dp_size"], worker["max_total_num_tokens"]) == (1, 1, POOL)
    assert worker["context_length"] == 32768
    assert worker["features"] == {
        "generation": True,
        "embeddings": False,
        "structured_output": True,
        "tools": True,
        "logprobs": True,
        "n": True,
    }
    assert worker["decode_tokens_per_s"] is None  # the warm-up prefilled one token, and nothing decoded since
    # SGLang's shape: the flags at the top level (resolved values where the runtime has them), one
    # internal state per replica, the version; ours (server_args, stats, pids) stays.
    assert info["schedule_policy"] == "fcfs" and info["max_running_requests"] == 1 and info["version"]
    assert [s["dp_rank"] for s in info["internal_states"]] == [0] and "last_gen_throughput" in info["internal_states"][
        0
    ]
    assert info["served_model_name"] == "tiny" and set(info["pids"]) == {"scheduler", "detokenizer"}
    for args in (info, info["server_args"]):
        assert args["api_key"] == args["admin_api_key"] == "<redacted>"
    assert ADMIN_KEY not in http.get("/server_info").text and USER_KEY not in http.get("/server_info").text

    model = http.get("/model_info").json()
    assert model == http.get("/get_model_info").json()
    assert model["is_generation"] is True and model["served_model_name"] == "tiny"
    assert model["model_path"] and model["tokenizer_path"]

    load = _load(http)
    assert set(load) == LOAD_KEYS and load["dp_rank"] == 0 and load["max_total_num_tokens"] == POOL
    assert load["num_reqs"] == load["num_tokens"] == load["num_waiting_tokens"] == 0
    assert abs(load["ts_tic"] - time.time()) < 60


def _generate_in_background(http: httpx.Client, rid: str, prompt_len: int, token: int = 5) -> threading.Thread:
    body = {"input_ids": [token] * prompt_len, "rid": rid, "sampling_params": LONG}
    thread = threading.Thread(target=http.post, args=("/generate",), kwargs={"json": body}, daemon=True)
    thread.start()
    return thread


def _v1_loads(http: httpx.Client) -> dict[str, Any]:
    """``/v1/loads``' one replica, after checking the envelope."""
    body = http.get("/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
    assert set(body) == {"timestamp", "dp_rank_count", "loads"} and body["dp_rank_count"] == 1, body
    assert datetime.datetime.fromisoformat(body["timestamp"]).tzinfo is not None
    (snapshot,) = body["loads"]
    assert set(snapshot) == V1_LOAD_KEYS and snapshot["dp_rank"] == 0, snapshot
    assert snapshot["max_total_num_tokens"] == POOL and snapshot["max_running_requests"] == 1
    return snapshot


def test_v1_loads_names_a_bad_section_and_has_no_version_route(http):
    r = http.get("/v1/loads", params={"include": "core,nonsense"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include" and "nonsense" in r.text
    idle = _v1_loads(http)
    assert idle["num_total_reqs"] == 0 and idle["token_usage"] == 0.0 and 0.0 <= idle["cache_hit_rate"] <= 1.0
    # smg 1.x takes a worker that answers /version for vLLM and then reads vLLM's metrics for its load
    assert http.get("/version").status_code == 404 and http.get("/server_info").json()["version"]


def test_load_moves_while_requests_run(http):
    running = _generate_in_background(http, "long-a", 10)
    assert wait_until(lambda: _load(http)["num_running_reqs"] == 1, timeout=60), _load(http)
    assert wait_until(lambda: _load(http)["decode_tokens_per_s"], timeout=60), _load(http)  # it decodes
    # --max-running-requests 1: it waits; nothing of it is cached (what is cached would not count)
    queued = _generate_in_background(http, "long-b", 50, token=6)
    assert wait_until(lambda: _load(http)["num_waiting_reqs"] == 1, timeout=60), _load(http)
    load = _load(http)
    assert load["num_reqs"] == 2 and load["num_waiting_tokens"] == load["num_pending_tokens"] == 50
    assert load["num_used_tokens"] >= 10 and load["num_tokens"] == load["num_used_tokens"] + 50
    snapshot = _v1_loads(http)  # smg 1.x's view of the same moment (no step runs while the second waits)
    assert snapshot["num_running_reqs"] == snapshot["num_waiting_reqs"] == 1 and snapshot["num_total_reqs"] == 2
    assert snapshot["num_waiting_uncached_tokens"] == 50 and snapshot["num_used_tokens"] >= 10
    assert snapshot["token_usage"] == snapshot["num_used_tokens"] / POOL and snapshot["utilization"] == 1.0
    for rid in ("long-a", "long-b"):
        assert http.post("/abort_request", json={"rid": rid}, headers=ADMIN).status_code == 200
    running.join(60)
    queued.join(60)
    assert wait_until(lambda: _load(http)["num_reqs"] == 0, timeout=30), _load(http)
    assert _load(http)["decode_tokens_per_s"] > 0  # kept while idle
    assert _load(http)["decode_bands"][0]["tokens_per_s"] > 0  # one request at a time: the batch-of-1 band
    assert http.get("/server_info").json()["worker"]["decode_tokens_per_s"] > 0


ADMIN_CALLS: list[tuple[str, dict[str, Any] | None]] = [
    ("/flush_cache", None),
    ("/abort_request", {"rid": "nothing-runs"}),
    ("/start_profile", {"output_dir": "runs/a"}),
    ("/stop_profile", None),
]


def test_admin_routes_need_the_admin_key(server, http, profile_root):
    with httpx.Client(base_url=server.url, timeout=120) as anyone:
        for path, body in ADMIN_CALLS:
            for headers in ({}, USER, {"Authorization": "Bearer wrong"}):
                r = anyone.post(path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key" and "--admin-api-key" in r.text
        assert anyone.get("/server_info").status_code == 401
        assert anyone.get("/health").status_code == 200  # probes stay open
    assert wait_until(lambda: http.post("/flush_cache", headers=ADMIN).status_code == 200, timeout=30)
    assert http.post("/abort_request", json={"rid": "nothing-runs"}, headers=ADMIN).status_code == 200
    r = http.post("/start_profile", json={"output_dir": "runs/a"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    trace = Path(r.json()["trace_path"])
    assert trace.parent == profile_root.resolve() / "runs" / "a"
    assert http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}).is_success
    r = http.post("/stop_profile", headers=ADMIN)
    assert r.status_code == 200 and Path(r.json()["trace_path"]) == trace and trace.is_file()


def test_user_and_admin_keys_open_the_api(server):
    for key in (USER_KEY, ADMIN_KEY):
        with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120) as client:
            out = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1
    with (
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()


def test_profile_output_dir_stays_under_profile_dir(http, profile_root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (profile_root / "escape").symlink_to(outside)
    for output_dir in (str(outside), "../outside", "runs/../../outside", "escape", "escape/deeper"):
        r = http.post("/start_profile", json={"output_dir": output_dir}, headers=ADMIN)
        assert r.status_code == 400, (output_dir, r.text)
        assert r.json()["error"]["param"] == "output_dir" and "output_dir" in r.json()["error"]["message"]
    assert not any(outside.iterdir())
    assert http.post("/stop_profile", headers=ADMIN).status_code == 400  # none was started


def test_an_http2_preface_is_505(server):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 505 ")


# ---- the SGLang model gateway in front of two workers ----------------------------------------------


def _registered(url: str, count: int) -> list[dict[str, Any]]:
    """smg's workers once ``count`` are registered and healthy, else []."""
    try:
        workers = httpx.get(url + "/workers", timeout=10).json()["workers"]
    except (httpx.HTTPError, ValueError):
        return []
    return workers if len(workers) == count and all(w["is_healthy"] for w in workers) else []


def _gateway_ranks(url: str, count: int) -> list[dict[str, Any]]:
    """smg 1.13's per-replica loads once it has ``count`` of them, else []."""
    try:
        loads = httpx.get(url + "/get_loads", timeout=10).json()["loads"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return loads if len(loads) == count else []


def _access_lines(server: ServerProcess) -> list[str]:
    return [line for line in server.lines if "radixserve.access" in line]


@pytest.fixture(scope="module")
def gateway_workers(tiny_llama_dir):
    """Two workers, the second with two replicas, at info level (their access logs are in
    their output), shared by both gateway versions' tests; started together."""
    common = ("--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--max-total-tokens", "4096", *PRIORITY)
    with (
        ServerProcess(*common, "--log-level", "info") as one,
        ServerProcess(*common, "--dp-size", "2", "--log-level", "info") as two,
    ):
        one.wait_ready()
        two.wait_ready()
        yield one, two


@pytest.mark.parametrize("version", list(SMG_COMMANDS))
def test_smg_fronts_two_workers(version, gateway_workers, tmp_path):
    command = SMG_COMMANDS[version]
    if command is None:
        pytest.skip(NOT_INSTALLED.format(version=version))
    one, two = gateway_workers
    urls = [one.url, two.url]
    seen = {server: len(_access_lines(server)) for server in (one, two)}  # what earlier tests logged

    def new_lines(server: ServerProcess) -> list[str]:
        return _access_lines(server)[seen[server] :]

    loads = httpx.get(two.url + "/get_load", timeout=30).json()
    assert [entry["dp_rank"] for entry in loads] == [0, 1] and all(set(e) == LOAD_KEYS for e in loads)
    info = httpx.get(two.url + "/server_info", timeout=30).json()
    assert info["worker"]["dp_size"] == 2 and info["worker"]["max_total_num_tokens"] == 2 * 4096
    assert [state["dp_rank"] for state in info["internal_states"]] == [0, 1]

    smg_log = tmp_path / "smg.log"
    # 1.13 polls the workers' loads (/v1/loads) only for a load-aware policy; every second here
    flags = ["--policy", "least_load", "--load-monitor-interval", "1"] if version == "1.13" else []
    with smg(command, ["--worker-urls", *urls, *(flags or ["--policy", "cache_aware"])], smg_log) as gateway:
        workers: list[dict[str, Any]] = []
        assert wait_until(lambda: workers.extend(_registered(gateway, 2)) or workers, SMG_TIMEOUT_S, 0.5), (
            smg_log.read_text()
        )
        assert sorted(w["url"] for w in workers) == sorted(urls) and {w["model_id"] for w in workers} == {"tiny"}
        if version == "1.13":  # it took them for SGLang workers (not vLLM) and reads each replica's load
            assert {w["runtime_type"] for w in workers} == {"sglang"}, workers
            ranks: list[dict[str, Any]] = []
            assert wait_until(lambda: ranks.extend(_gateway_ranks(gateway, 3)) or ranks, SMG_TIMEOUT_S, 0.5)
            assert sorted((r["worker"], r["dp_rank"]) for r in ranks) == sorted(
                [(urls[0], 0), (urls[1], 0), (urls[1], 1)]
            )
            assert all(r["max_total_num_tokens"] == 4096 and r["num_total_reqs"] == 0 for r in ranks), ranks
        else:
            gateway_loads = httpx.get(gateway + "/get_loads", timeout=30).json()["workers"]
            assert len(gateway_loads) == 2 and all(entry["load"] >= 0 for entry in gateway_loads), gateway_loads

        with openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            out = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
        assert (
            out.model == "tiny" and out.usage.completion_tokens >= 1 and isinstance(out.choices[0].message.content, str)
        )

        def served() -> list[str]:
            return [line for s in (one, two) for line in new_lines(s) if "POST /v1/chat/completions 200" in line]

        assert wait_until(lambda: len(served()) == 1, timeout=10), served()

    for server in (one, two):
        lines = new_lines(server)
        assert any("GET /model_info 200" in line for line in lines), lines
        # 1.13 also probes /version (vLLM's: we have none, so it takes us for SGLang) and /loads (unused)
        probes = ("GET /version 404", "GET /loads 404") if version == "1.13" else ()
        assert not [line for line in lines if " 404 " in line and not any(p in line for p in probes)]
    assert "falling back" not in smg_log.read_text()  # smg found /server_info and /model_info
