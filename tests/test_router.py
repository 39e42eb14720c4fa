"""`radixserve router` in front of a mixed fleet, all real processes on 127.0.0.1: three
workers serving the tiny Llama on different backends (the CPU defaults; the example
kernel plugin, pip-installed for its worker alone; the Triton backends under
TRITON_INTERPRET=1, about 15x slower: the stand-in for a weaker device, and without
structured output: a worker lacking a feature the others have), the official
``openai`` client in front."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import openai
import pytest
from helpers_pool import ServerPool, assert_whole_pool_back
from helpers_server import ServerProcess, metric, process_alive, serving, wait_until

REPO = Path(__file__).resolve().parents[1]
FAST_CHECKS = (
    "--health-check-interval-secs", "0.5", "--load-poll-interval-secs", "0.5", "--health-failure-threshold", "1",
    "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "2", "--retry-initial-backoff-ms", "20",
)  # fmt: skip


# What ``auto`` takes is not what these tests check: the highest-priority usable backend, without
# timing the candidates at the model's shapes first (seconds at each worker's start).
PRIORITY = ("--backend-selection", "priority")
TRITON_NO_GRAMMAR = ("--attention-backend", "triton", "--elementwise-backend", "triton", "--grammar-backend", "none")


@contextlib.contextmanager
def router_over(*urls: str, flags: tuple[str, ...] = FAST_CHECKS) -> Iterator[ServerProcess]:
    with ServerProcess("--worker-urls", *urls, *flags, command="router") as router:
        router.wait_ready(60)
        assert wait_until(lambda: len(workers_of(router.url)) == len(urls), 60), router.log
        yield router


def workers_of(url: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    return httpx.get(url + "/workers", headers=headers, timeout=10).json()["workers"]


@pytest.fixture(scope="module")
def example_plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/kernel-plugin installed into a directory of its own: on a worker's
    PYTHONPATH, its entry point is found like any installed plugin's."""
    target = tmp_path_factory.mktemp("example-plugin")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "install", "--no-deps"]
    source = str(REPO / "examples/kernel-plugin")
    subprocess.run([*pip, "--no-build-isolation", "--target", str(target), source], check=True, capture_output=True)
    return target


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, example_plugin_dir: Path) -> Iterator[dict[str, ServerProcess]]:
    """Three workers of the tiny Llama as "tiny", started together."""
    common = (
        "--model",
        str(tiny_llama_dir),
        "--served-model-name",
        "tiny",
        "--log-level",
        "info",
        "--max-total-tokens",
        "4096",
        *PRIORITY,
    )
    path = os.pathsep.join(filter(None, [str(example_plugin_dir), os.environ.get("PYTHONPATH")]))
    specs = {
        "cpu": ((), {}),
        "example": (("--attention-backend", "example_sdpa", "--gemm-backend", "example_gemm"), {"PYTHONPATH": path}),
        # Triton interpreted (a slow device), and without structured output (a feature the others have)
        "triton": (TRITON_NO_GRAMMAR, {"TRITON_INTERPRET": "1"}),
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        workers = {
            name: stack.enter_context(ServerProcess(*common, *flags, env=env)) for name, (flags, env) in specs.items()
        }
        for worker in workers.values():
            worker.wait_ready()
        yield workers
        stop_together(workers.values())


def stop_together(servers: Iterable[ServerProcess]) -> None:
    """SIGTERM to every server still running, then wait for each: they drain and stop at the same time."""
    servers = list(servers)
    for server in servers:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def router(fleet: dict[str, ServerProcess]) -> Iterator[ServerProcess]:
    with router_over(*(w.url for w in fleet.values())) as router:
        yield router


def client_of(router: ServerProcess, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=300, **kw)


def one_request(client: openai.OpenAI, i: int) -> str:
    """One request of a mixed workload; what it returned, checked."""
    kind = i % 5
    prompt = f"request {i}: " + "the same long system prompt " * (1 + i % 3)
    if kind == 0:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8)
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    elif kind == 1:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=2, logprobs=2)
        assert len(r.choices) == 2 and all(c.logprobs.top_logprobs for c in r.choices)
    elif kind == 2:
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=8, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    elif kind == 3:
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8, stream=True
        )
        assert [c for c in stream if c.choices and c.choices[0].finish_reason]
    else:
        base = str(client.base_url).removesuffix("/v1/")
        r = httpx.post(base + "/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 8}}, timeout=300)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1
    return ("chat", "completions", "stream", "chat-stream", "generate")[kind]


# ---- one endpoint over the fleet --------------------------------------------------------
def test_the_fleet_is_one_model_with_each_workers_backends(router, fleet):
    models = client_of(router).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    workers = {w["url"]: w for w in workers_of(router.url)}
    assert set(workers) == {w.url for w in fleet.values()}
    assert all(w["healthy"] and w["circuit_breaker"] == "closed" for w in workers.values())
    attention = {name: workers[w.url]["backends"].get("attention") for name, w in fleet.items()}
    assert attention == {"cpu": attention["cpu"], "example": "example_sdpa", "triton": "triton"}
    assert attention["cpu"] not in ("example_sdpa", "triton")


def test_a_mixed_workload_all_succeeds_and_the_slow_worker_gets_a_small_share(router, fleet):
    client = client_of(router)
    warm = {"model": "tiny", "prompt": "warm", "max_tokens": 16}
    with ThreadPoolExecutor(len(fleet)) as pool:  # each worker decodes once, so its throughput is measured
        list(pool.map(lambda w: httpx.post(w.url + "/v1/completions", json=warm, timeout=300), fleet.values()))
    assert wait_until(lambda: all(w["load"]["decode_tokens_per_s"] for w in workers_of(router.url)), 30)
    before = {name: metric(router.url, "radixserve_router:requests_total", worker=w.url) for name, w in fleet.items()}
    with ThreadPoolExecutor(8) as pool:
        kinds = list(pool.map(lambda i: one_request(client, i), range(40)))
    assert len(kinds) == 40
    routed = {
        name: metric(router.url, "radixserve_router:requests_total", worker=w.url) - before[name]
        for name, w in fleet.items()
    }
    assert sum(routed.values()) == 40
    # The slow worker gets the smallest share, below round robin's third. The two fast ones
    # may split the rest in any proportion: one that runs 8 streams as fast as 1 takes them all.
    assert routed["triton"] <= min(routed["cpu"], routed["example"]) and routed["triton"] < 40 / 3, routed
    assert all(w["load"]["router_in_flight"] == 0 for w in workers_of(router.url))  # every hold released
    served = [w.url for name, w in fleet.items() if routed[name]]
    assert wait_until(lambda: all("worker=" + url in router.log for url in served), 10)  # the access log names them


def test_an_inference_route_answers_a_wrong_method_or_body_in_the_error_envelope(router):
    wrong_method = httpx.get(router.url + "/v1/completions")
    assert wrong_method.status_code == 405
    assert "POST" in wrong_method.json()["error"]["message"]
    not_json = httpx.post(router.url + "/v1/chat/completions", content=b"{nope", timeout=30)
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    no_model = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    bad_objective = httpx.post(router.url + "/v1/completions", json=body, headers={"X-SLO-TPOT-MS": "soon"}, timeout=30)
    assert bad_objective.status_code == 400 and bad_objective.json()["error"]["param"] == "x-slo-tpot-ms"
    assert "'soon' is not a positive number of milliseconds" in bad_objective.json()["error"]["message"]
    assert httpx.get(router.url + "/no/such/route").json()["error"]["type"] == "not_found_error"


def test_the_client_not_the_server_closes_an_idle_connection(router, fleet):
    """The router and a worker keep an idle connection open past the 5 s after which the
    openai client (httpx) drops its own: were the server to close first, at about the time
    the client reuses the connection, the request written meanwhile would be lost
    ("Server disconnected without sending a response")."""
    client_expiry_s = httpx.Limits().keepalive_expiry
    assert client_expiry_s is not None
    connections = [
        http.client.HTTPConnection(url.removeprefix("http://"), timeout=30) for url in (router.url, fleet["cpu"].url)
    ]
    body = json.dumps({"model": "tiny", "prompt": "kept", "max_tokens": 2})
    sockets = []
    for connection in connections:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        assert connection.getresponse().read() and connection.sock is not None
        sockets.append(connection.sock)
    time.sleep(client_expiry_s + 0.5)
    for connection, sock in zip(connections, sockets, strict=True):
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["choices"]
        assert connection.sock is sock  # the same connection served both
        connection.close()


def test_a_request_goes_only_to_workers_that_support_what_it_asks(router, fleet):
    slow = fleet["triton"].url
    features = {w["url"]: w["features"] for w in workers_of(router.url)}
    assert not features[slow]["structured_output"] and features[fleet["cpu"].url]["structured_output"]
    client = client_of(router)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    before = metric(router.url, "radixserve_router:requests_total", worker=slow)
    for i in range(6):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"json {i}"}],
            response_format=response_format,
            max_tokens=64,
            logit_bias={},
            seed=i,
        )
        assert out.choices[0].finish_reason in ("stop", "length")
    assert metric(router.url, "radixserve_router:requests_total", worker=slow) == before
    with router_over(slow) as only_slow:  # no worker of the model has it: a 400 naming the field
        with pytest.raises(openai.BadRequestError) as exc:
            client_of(only_slow).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], response_format=response_format
            )
        assert exc.value.body["param"] == "response_format" and "structured output" in exc.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            client_of(only_slow).completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_workers_leave_and_join_at_runtime(router, fleet):
    slow = fleet["triton"].url
    gone = httpx.delete(router.url + "/workers/" + quote(slow, safe=""), timeout=10)
    assert gone.status_code == 200, gone.text
    assert slow not in {w["url"] for w in workers_of(router.url)}
    assert httpx.delete(router.url + "/workers/" + quote(slow, safe=""), timeout=10).status_code == 404
    client = client_of(router)
    assert client.completions.create(model="tiny", prompt="still served", max_tokens=4).choices[0].text is not None
    back = httpx.post(router.url + "/workers", json={"url": slow}, timeout=30)
    assert back.status_code == 200 and back.json()["worker"]["backends"]["attention"] == "triton", back.text
    assert len(workers_of(router.url)) == 3


def test_a_different_model_under_the_same_name_is_refused(router, tiny_model_factory):
    with serving(tiny_model_factory(arch="qwen2"), "--max-total-tokens", "2048", *PRIORITY) as other:
        answer = httpx.post(router.url + "/workers", json={"url": other.url}, timeout=30)
        assert answer.status_code == 409, answer.text
        assert "Qwen2ForCausalLM" in answer.json()["error"]["message"]
    assert len(workers_of(router.url)) == 3


def test_a_client_that_leaves_aborts_its_request_on_the_worker(fleet):
    worker = fleet["triton"]  # the slow one: its requests last long enough to be left
    with router_over(worker.url) as router:
        body = {"model": "tiny", "prompt": "a long story", "max_tokens": 500, "ignore_eos": True}
        with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert [next(lines) for _ in range(3)]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/completions", json=body, timeout=1)
        # The worker's access log: both requests ended by the client (499), well short of 500 tokens.
        assert wait_until(lambda: len(_client_closed(worker.log)) == 2, 30), worker.log[-3000:]
        assert all(completion < 100 for completion in _client_closed(worker.log)), _client_closed(worker.log)
        assert_whole_pool_back(ServerPool(worker.url))
        assert router.log.count(" 499 worker=" + worker.url) == 2


def _client_closed(log: str) -> list[int]:
    """The completion token counts of the worker's 499 access-log lines."""
    return [int(m) for m in re.findall(r"POST /v1/completions 499 prompt=\d+ completion=(\d+)", log)]


def test_admission_answers_429_when_its_queue_is_full_and_408_after_the_queue_timeout(fleet):
    flags = (*FAST_CHECKS, "--max-concurrent-requests", "1", "--queue-size", "1", "--queue-timeout-secs", "1")
    with router_over(fleet["triton"].url, flags=flags) as router:
        body = {"model": "tiny", "prompt": "hold the place", "max_tokens": 30, "ignore_eos": True}  # seconds there

        def post(delay: float) -> int:
            time.sleep(delay)
            return httpx.post(router.url + "/v1/completions", json=body, timeout=60).status_code

        with ThreadPoolExecutor(3) as pool:
            statuses = sorted(pool.map(post, (0.0, 0.3, 0.6)))
        assert statuses == [200, 408, 429], statuses
        assert metric(router.url, "radixserve_router:admission_refused_total", reason="queue_full") == 1

        # A client that leaves while its request waits for admission gives its place up:
        # the request never reaches a worker, and the next one is admitted.
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, 0.0)
            time.sleep(0.3)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(router.url + "/v1/completions", json=body, timeout=0.4)
            assert first.result() == 200
        assert wait_until(lambda: " 499 worker=- tries=0 " in router.log, 10), router.log[-2000:]
        assert metric(router.url, "radixserve_router:admission_queue_depth") == 0
        assert post(0.0) == 200


def test_keys_user_key_for_inference_admin_key_for_the_fleet(fleet):
    flags = (*FAST_CHECKS, "--api-key", "user", "--admin-api-key", "admin")
    with ServerProcess("--worker-urls", fleet["cpu"].url, *flags, command="router") as router:
        router.wait_ready(60)
        user, admin = {"Authorization": "Bearer user"}, {"Authorization": "Bearer admin"}
        assert httpx.get(router.url + "/v1/models").status_code == 401
        assert wait_until(lambda: httpx.get(router.url + "/v1/models", headers=user).json()["data"], 30)
        assert httpx.get(router.url + "/workers", headers=user).status_code == 401
        assert httpx.get(router.url + "/workers", headers=admin).status_code == 200
        assert httpx.get(router.url + "/health").status_code == 200  # probes stay open


def test_sigterm_lets_a_stream_finish_then_the_router_exits(fleet):
    with router_over(fleet["triton"].url) as router:
        body = {"model": "tiny", "prompt": "finish me", "max_tokens": 20, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            router.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest if x.startswith("data: {")]
        assert finish[-1] == "length"
        assert router.wait_exit(30) == 0


def test_a_killed_worker_loses_no_request_its_breaker_opens_and_it_rejoins_after_a_restart(fleet):
    """Last: it kills the CPU worker (and starts a new one on its port). The Triton worker
    stays out, so that the retried requests do not wait on it."""
    victim, other = fleet["cpu"], fleet["example"]
    children = list(httpx.get(victim.url + "/get_server_info", timeout=30).json()["pids"].values())
    with router_over(victim.url, other.url, flags=(*FAST_CHECKS, "--policy", "round_robin")) as router:
        client = client_of(router)
        outcomes: list[str] = []

        def worker_loop(i: int) -> None:
            for j in range(5):
                r = client.completions.create(
                    model="tiny", prompt=f"survive {i}.{j} " * 8, max_tokens=150, extra_body={"ignore_eos": True}
                )
                outcomes.append(r.choices[0].finish_reason)

        threads = [threading.Thread(target=worker_loop, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        assert wait_until(lambda: _in_flight(router, victim.url) >= 2, 60)
        victim.proc.kill()  # no drain, no goodbye: the requests on it fail mid-answer
        assert wait_until(lambda: _state(router, victim.url)[1] == "open", 10), _state(router, victim.url)
        for t in threads:
            t.join(300)
        assert outcomes.count("length") == 30, outcomes  # every request answered: none lost
        assert _in_flight(router, other.url) == 0 and _in_flight(router, victim.url) == 0
        assert metric(router.url, "radixserve_router:worker_errors_total", worker=victim.url) >= 2
        assert metric(router.url, "radixserve_router:retries_total", worker=victim.url) >= 2
        assert not _state(router, victim.url)[0]  # and the health checks took it out
        for pid in children:
            assert wait_until(lambda pid=pid: not process_alive(pid), 30), f"worker child {pid} outlived its server"

        port = victim.url.rsplit(":", 1)[1]
        args = victim.proc.args[victim.proc.args.index("serve") + 3 :]  # after "serve --port 0"
        with ServerProcess(*args, "--port", port) as revived:
            revived.wait_ready()
            assert wait_until(lambda: _state(router, victim.url) == (True, "closed"), 30)
            before = metric(router.url, "radixserve_router:requests_total", worker=victim.url)
            with ThreadPoolExecutor(4) as pool:
                list(
                    pool.map(
                        lambda i: client.completions.create(model="tiny", prompt=f"back {i}", max_tokens=8), range(12)
                    )
                )
            assert metric(router.url, "radixserve_router:requests_total", worker=victim.url) > before


def _in_flight(router: ServerProcess, url: str) -> int:
    return {w["url"]: w for w in workers_of(router.url)}[url]["load"]["router_in_flight"]


def _state(router: ServerProcess, url: str) -> tuple[bool, str]:
    worker = {w["url"]: w for w in workers_of(router.url)}[url]
    return worker["healthy"], worker["circuit_breaker"]
