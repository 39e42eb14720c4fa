"""`radixserve router` over workers serving LoRA adapters: what the router reads of a
request's adapter and whom it prefers (its parts, no servers), then two real workers of
the tiny Llama on 127.0.0.1 with different adapters, behind one router: requests follow
the adapter to the worker that holds it, an adapter held nowhere is loaded on the chosen
worker (once, however many requests wait for it), a load that fails is not retried over
and over, and an adapter no worker knows gets the worker's own 404."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers_server import PRIORITY_BACKENDS, ServerProcess, metric, wait_until
from test_router import FAST_CHECKS, router_over, stop_together, workers_of

from radixserve.checkpoints.random_adapter import build_random_adapter
from radixserve.router.args import RouterArgs
from radixserve.router.fleet import Fleet
from radixserve.router.lora import AdapterRouting, Target
from radixserve.router.metrics import RouterMetrics
from radixserve.router.request_info import RequestInfo, TokenEstimator, read_request
from radixserve.router.upstream import Reply, Upstream
from radixserve.router.worker import CircuitBreaker, LoRAFacts, Worker, WorkerFacts

ADMIN_KEY = "lora-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LOADS = "radixserve_router:adapter_loads_total"


# ---- the parts ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("route", "payload", "lora_path"),
    [
        ("completions", {"model": "m", "prompt": "x", "lora_path": "A"}, "A"),
        ("chat", {"model": "A", "messages": []}, None),  # an adapter named by ``model``: the fleet resolves it
        ("generate", {"text": "x", "lora_path": "A"}, "A"),
        ("generate", {"text": ["x", "y", "z"], "lora_path": [None, "A", "A"]}, "A"),  # the others: the base model
        ("generate", {"text": ["x", "y"], "lora_path": ["A", "B"]}, None),  # no one adapter: no preference
        ("generate", {"text": ["x", "y"], "lora_path": [None, None]}, None),
    ],
)
def test_the_adapter_a_request_names_by_lora_path(route, payload, lora_path):
    assert read_request(route, payload, TokenEstimator()).lora_path == lora_path


def _worker(url: str, model: str = "tiny", adapters: dict[str, str] | None = None, max_loaded: int | None = None):
    lora = LoRAFacts(adapters, max_loaded) if adapters is not None else None
    return Worker(url, WorkerFacts(model, lora=lora), CircuitBreaker(5, 1, 10))


def _routing(*workers: Worker) -> AdapterRouting:
    fleet = Fleet(RouterArgs(), Upstream(60), [], RouterMetrics())
    for worker in workers:
        fleet.workers[worker.url] = worker
        if worker.facts.lora is not None:
            fleet.record_lora(worker, worker.facts.lora)  # the fleet remembers its adapters' paths
    return AdapterRouting(fleet, fleet.upstream, fleet.metrics)


def test_the_model_a_request_names_is_a_served_model_or_an_adapter_over_one():
    routing = _routing(_worker("w1", adapters={"A": "/a"}), _worker("w2", model="other"))

    def target(model: str | None, lora_path: str | None = None) -> Target:
        return routing.target(RequestInfo(model=model, stream=False, lora_path=lora_path))

    assert target("tiny") == Target("tiny", None)
    assert target("tiny", "A") == Target("tiny", "A")
    assert target("A") == Target("tiny", "A")
    assert target("tiny:A") == Target("tiny", "A")
    assert target("tiny:B") == Target("tiny", "B")
    assert target("A", "B") == Target("tiny", "B")  # lora_path wins, as on the worker
    assert target(None, "A") == Target(None, "A")  # /generate: the fleet's one model
    assert target("nope") == Target("tiny", "nope")  # the one model served with LoRA answers for it
    assert target("other") == Target("other", None)


def test_holders_first_then_workers_with_room_to_load_it_then_any():
    holder = _worker("holder", adapters={"A": "/a", "B": "/b"})
    full = _worker("full", adapters={"C": "/c"}, max_loaded=1)
    roomy = _worker("roomy", adapters={})
    plain = _worker("plain")  # LoRA off
    routing = _routing(holder, full, roomy, plain)
    everyone = [holder, full, roomy, plain]
    assert routing.place(everyone, None) == everyone
    assert routing.place(everyone, "A") == [holder]
    assert routing.place([full, roomy, plain], "A") == [roomy]  # its path is known: load it where there is room
    assert routing.place([full, plain], "A") == [full]  # no room anywhere: the worker says why
    assert routing.place([full, roomy, plain], "nope") == [full, roomy]  # no path: a LoRA worker answers
    assert routing.place([plain], "nope") == [plain]


def test_concurrent_requests_for_an_adapter_held_nowhere_wait_for_one_load():
    holder, target = _worker("holder", adapters={"A": "/a"}), _worker("target", adapters={})
    routing = _routing(holder, target)
    sent: list[tuple[str, Any]] = []

    class SlowLoads(Upstream):
        async def post(self, url: str, headers: dict[str, str], timeout_s: float, body: Any = None) -> Reply:
            sent.append((url, body))
            await asyncio.sleep(0.05)
            return Reply(200, json.dumps({"success": True, "loaded_adapters": {"A": "/a"}}).encode())

    routing.upstream = SlowLoads(60)

    async def burst() -> None:
        chosen = [routing.place([target], "A") for _ in range(2)]  # the holder is not a candidate (say, down)
        assert chosen == [[target], [target]]
        await asyncio.gather(*(routing.prepare(target, "A") for _ in range(4)))
        assert routing.place([holder, target], "A") == [holder, target]

    asyncio.run(burst())
    assert sent == [("target/load_lora_adapter", {"lora_name": "A", "lora_path": "/a"})]
    assert target.facts.holds("A")


# ---- two LoRA workers behind one router -------------------------------------------------
@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: build_random_adapter(tiny_llama_dir, root / name, seed=i) for i, name in enumerate("ABC")}


@pytest.fixture(scope="module")
def workers(tiny_llama_dir: Path, adapters: dict[str, Path]) -> Iterator[list[ServerProcess]]:
    """Worker 1 holds B and C, worker 2 holds A; their admin routes take ``ADMIN_KEY``."""
    common = (
        *("--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--log-level", "warning"),
        *("--max-total-tokens", "4096", "--enable-lora", "--admin-api-key", ADMIN_KEY, *PRIORITY_BACKENDS),
    )
    held = (("--lora-paths", f"B={adapters['B']}", f"C={adapters['C']}"), ("--lora-paths", f"A={adapters['A']}"))
    servers = [ServerProcess(*common, *lora) for lora in held]
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        stop_together(servers)


@pytest.fixture(scope="module")
def router(workers: list[ServerProcess]) -> Iterator[ServerProcess]:
    with router_over(*(w.url for w in workers), flags=(*FAST_CHECKS, "--worker-admin-api-key", ADMIN_KEY)) as router:
        yield router


def _adapters_of(router: ServerProcess) -> dict[str, set[str]]:
    return {w["url"]: set(w["lora"]["adapters"]) for w in workers_of(router.url)}


def _complete(router: ServerProcess, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": "a lora", "max_tokens": 2, **extra}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=60)


def _generate(router: ServerProcess, text: str | list[str], lora_path: str | list[str | None]) -> httpx.Response:
    body = {"text": text, "lora_path": lora_path, "sampling_params": {"max_new_tokens": 2}}
    return httpx.post(router.url + "/generate", json=body, timeout=60)


def _requests(router: ServerProcess, worker: ServerProcess) -> float:
    return metric(router.url, "radixserve_router:requests_total", worker=worker.url)


def _unload_everywhere_the_router_sees(router: ServerProcess, worker: ServerProcess, name: str) -> None:
    assert httpx.post(worker.url + "/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN).status_code == 200
    assert wait_until(lambda: not any(name in held for held in _adapters_of(router).values()), 10)


def test_the_router_lists_the_adapters_its_workers_hold(router, workers, adapters):
    assert _adapters_of(router) == {workers[0].url: {"B", "C"}, workers[1].url: {"A"}}
    cards = {m["id"]: m for m in httpx.get(router.url + "/v1/models", timeout=10).json()["data"]}
    assert list(cards) == ["tiny", "A", "B", "C"]
    assert cards["A"]["parent"] == "tiny" and cards["A"]["root"] == str(adapters["A"])
    assert httpx.get(router.url + "/v1/models/A", timeout=10).json()["parent"] == "tiny"


def test_requests_for_an_adapter_all_go_to_the_worker_that_holds_it(router, workers):
    other, holder = workers
    scheduled = "radixserve:num_requests_total"  # the workers' own count: scheduler requests, one per prompt
    before = [metric(w.url, scheduled) for w in workers], [_requests(router, w) for w in workers]
    answers = [
        _complete(router, "A"),
        _complete(router, "tiny:A"),
        _complete(router, "tiny", lora_path="A"),
        httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "A", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=60,
        ),
        _generate(router, "x", "A"),
        _generate(router, ["x", "y"], ["A", None]),  # the other prompt: the base model
    ]
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert answers[0].json()["model"] == "A"
    assert [metric(w.url, scheduled) for w in workers] == [before[0][0], before[0][1] + 7]
    assert [_requests(router, w) for w in workers] == [before[1][0], before[1][1] + 6]


def test_an_adapter_held_nowhere_is_loaded_once_on_the_chosen_worker(router, workers):
    _unload_everywhere_the_router_sees(router, workers[0], "B")
    assert "B" not in {m["id"] for m in httpx.get(router.url + "/v1/models", timeout=10).json()["data"]}
    loaded, before = metric(router.url, LOADS, outcome="loaded"), [_requests(router, w) for w in workers]
    with ThreadPoolExecutor(4) as pool:  # the router remembers B's path: it has one worker load it, once
        answers = list(pool.map(lambda _: _complete(router, "B"), range(4)))
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert metric(router.url, LOADS, outcome="loaded") == loaded + 1
    (chosen,) = [w for w in workers if "B" in _adapters_of(router)[w.url]]
    assert "B" in {m["id"] for m in httpx.get(chosen.url + "/v1/models", timeout=10).json()["data"]}
    assert {w.url: _requests(router, w) - b for w, b in zip(workers, before, strict=True)}[chosen.url] == 4
    assert "loaded LoRA adapter 'B'" in router.log


def test_a_load_that_fails_is_tried_once_per_worker_and_the_worker_answers(router, workers, adapters):
    _unload_everywhere_the_router_sees(router, workers[0], "C")
    shutil.rmtree(adapters["C"])  # the path the router remembers leads nowhere now
    failed = metric(router.url, LOADS, outcome="failed")
    answers = [_complete(router, "C") for _ in range(3)]
    assert [a.status_code for a in answers] == [404] * 3, [a.text for a in answers]
    assert all(a.json()["error"]["param"] == "model" for a in answers)
    assert metric(router.url, LOADS, outcome="failed") == failed + 2  # each worker once, then not for a while
    assert "did not load LoRA adapter 'C'" in router.log and "adapter_config.json" in router.log


def test_an_adapter_no_worker_knows_gets_the_workers_own_answer(router):
    loads = metric(router.url, LOADS)
    by_model = _complete(router, "no-such-adapter")
    assert by_model.status_code == 404, by_model.text
    error = by_model.json()["error"]
    assert error["param"] == "model" and "does not exist; this server serves" in error["message"]  # the worker's
    by_path = _complete(router, "tiny", lora_path="no-such-adapter")
    assert by_path.status_code == 400 and by_path.json()["error"]["param"] == "lora_path", by_path.text
    assert metric(router.url, LOADS) == loads
