"""Data parallelism (--dp-size): the load-balance policies and the DP controller
on their own, then real replicas behind a real controller: an offline Engine and
two servers (real processes, ZMQ, HTTP, the openai client), whose greedy tokens
equal dp=1's, spread over both replicas, abort and flush on both, and survive
the death of one replica."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from helpers_pool import ReplicaPool, ServerPool, assert_whole_pool_back
from helpers_server import metric, serving, wait_until

from radixserve import Engine
from radixserve.config import ServerArgs
from radixserve.load_balance import DP_POLICIES, POLICIES, Load, LoadBalancer
from radixserve.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    GenerateRequest,
    ReplicaDown,
    ReplicaFinished,
    TokenBatch,
)
from radixserve.runtime.processes.dp_controller import DPController, total_stats
from radixserve.sampling.params import SamplingParams
from radixserve_torch.platform import CpuPlatform

PROMPTS = [f"the number {i} is" for i in range(8)]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
LONG = 900  # tokens: seconds of decoding, so the requests still run when the test acts
# How auto picks a backend is not what this module tests: the highest-priority one, without
# timing each candidate at the model's shapes when a replica starts.
PRIORITY = "priority"


# ---- the policies and the controller, without processes --------------------------------


def test_round_robin_cycles_over_the_live_replicas():
    lb = LoadBalancer("round_robin")
    loads = {k: Load(requests=k) for k in range(3)}
    assert [lb.choose(loads) for _ in range(4)] == [0, 1, 2, 0]
    del loads[2]  # replica 2 died
    assert [lb.choose(loads) for _ in range(3)] == [1, 0, 1]
    with pytest.raises(ValueError, match="no data-parallel replica"):
        lb.choose({})


def test_shortest_queue_and_minimum_tokens_with_ties_in_turn():
    loads = {0: Load(requests=3, tokens=10), 1: Load(requests=1, tokens=900), 2: Load(2, 50)}
    assert LoadBalancer("shortest_queue").choose(loads) == 1
    assert LoadBalancer("minimum_tokens").choose(loads) == 0
    idle = {0: Load(), 1: Load()}
    for method in ("shortest_queue", "minimum_tokens"):
        lb = LoadBalancer(method)
        assert [lb.choose(idle) for _ in range(4)] == [0, 1, 0, 1]  # equals are used in turn
    with pytest.raises(ValueError, match="load_balance_method"):
        LoadBalancer("random")


def test_the_dp_methods_are_the_shared_policies_the_dp_controller_has():
    """--load-balance-method takes its choices from load_balance.POLICIES: SGLang's three names, each a
    policy the router has too; a router-only name is refused saying where it belongs."""
    assert DP_POLICIES == ("round_robin", "shortest_queue", "minimum_tokens")
    assert all(POLICIES[name].dp and POLICIES[name].router for name in DP_POLICIES)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    action = next(a for a in parser._actions if a.dest == "load_balance_method")
    assert tuple(action.choices or ()) == DP_POLICIES
    assert all(f"{name} (" in (action.help or "") for name in DP_POLICIES)  # each with its meaning
    for name in DP_POLICIES:
        assert ServerArgs.from_cli_args(parser.parse_args(["--load-balance-method", name])).load_balance_method == name
    with pytest.raises(ValueError, match=r"load_balance_method: .*got 'power_of_two' \(only radixserve router"):
        ServerArgs(load_balance_method="power_of_two")  # type: ignore[arg-type]


class _Wires:
    """The controller's outgoing messages, by destination."""

    def __init__(self) -> None:
        self.replicas: dict[int, list[Any]] = {0: [], 1: []}
        self.detokenizer: list[TokenBatch] = []
        self.tm: list[ControlReply] = []

    def controller(self, method: str = "shortest_queue") -> DPController:
        args = ServerArgs(dp_size=2, load_balance_method=method)  # type: ignore[arg-type]
        return DPController(args, lambda k, msg: self.replicas[k].append(msg), self.detokenizer.append, self.tm.append)


def _request(rid: str, prompt_len: int = 4, max_new: int = 16) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=[1] * prompt_len, sampling_params=SamplingParams(max_new_tokens=max_new))


def _stats(**kw: Any) -> dict[str, Any]:
    base = dict(
        num_running_reqs=0,
        num_queue_reqs=0,
        num_waiting_tokens=0,
        decode_tokens_per_s=None,
        prefill_tokens_per_s=None,
        token_usage=0.0,
        tokens_in_use=0,
        cache_hit_rate=0.0,
        num_retracted_reqs=0,
        prompt_tokens_total=0,
        cached_tokens_total=0,
        generation_tokens_total=0,
        max_total_tokens=100,
        free_tokens=100,
        cached_tokens_in_tree=0,
        locked_cached_tokens=0,
        private_tokens=0,
        memory_invariant_ok=True,
        memory_error=None,
    )
    return {**base, **kw}


def test_controller_dispatches_routes_aborts_and_counts_finishes():
    wires = _Wires()
    ctl = wires.controller("minimum_tokens")
    ctl.handle(_request("a", prompt_len=100))  # replica 0 (a tie, in turn)
    ctl.handle(_request("b"))  # replica 1
    ctl.handle(_request("c"))  # replica 1 again: fewer tokens than replica 0
    assert [m.rid for m in wires.replicas[0]] == ["a"] and [m.rid for m in wires.replicas[1]] == ["b", "c"]
    ctl.handle(AbortRequest("c"))  # to its own replica only
    assert wires.replicas[1][-1] == AbortRequest("c") and len(wires.replicas[0]) == 1
    ctl.handle(ReplicaFinished(1, ["b", "c"]))
    ctl.handle(AbortRequest("b"))  # finished: nothing to abort
    assert len(wires.replicas[1]) == 3
    ctl.handle(AbortRequest(""))  # everything, everywhere
    assert wires.replicas[0][-1] == wires.replicas[1][-1] == AbortRequest("")
    assert [(r.load.requests, r.dispatched_total) for r in ctl.replicas] == [(1, 1), (0, 2)]


def test_controller_merges_control_calls_and_survives_a_dead_replica():
    wires = _Wires()
    ctl = wires.controller()
    ctl.handle(_request("on-0"))
    ctl.handle(_request("on-1"))
    ctl.handle(ControlRequest("server_info", call_id=7))
    asks = {k: wires.replicas[k][-1] for k in (0, 1)}
    assert asks[0].call_id != asks[1].call_id  # the controller's own ids: the replies say who answered
    ctl.handle(ControlReply("server_info", asks[1].call_id, {"stats": _stats(generation_tokens_total=5), "x": 1}))
    assert not wires.tm  # waits for both
    ctl.handle(ControlReply("server_info", asks[0].call_id, {"stats": _stats(generation_tokens_total=2), "x": 0}))
    (reply,) = wires.tm
    assert reply.call_id == 7 and reply.payload["x"] == 0  # replica 0's summary
    assert reply.payload["stats"]["generation_tokens_total"] == 7
    assert [r["stats"]["generation_tokens_total"] for r in reply.payload["replicas"]] == [2, 5]

    ctl.handle(ControlRequest("flush_cache", call_id=8))
    ctl.handle(ControlReply("flush_cache", wires.replicas[0][-1].call_id, True))
    ctl.handle(ReplicaDown(1, "scheduler-dp1 exited with code -9"))  # before it answered
    assert wires.tm[-1] == ControlReply("flush_cache", 8, True)  # the live replica's answer
    (batch,) = wires.detokenizer  # replica 1's request ends with a 500
    (out,) = batch.outputs
    assert out.rid == "on-1" and out.finish_reason.status_code == 500
    assert "replica 1 died (scheduler-dp1 exited with code -9)" in out.finish_reason.message
    assert out.detokenize is not None  # the detokenizer may never have seen it
    ctl.handle(_request("after"))
    assert wires.replicas[0][-1].rid == "after"  # only the live one is used
    ctl.handle(ControlRequest("server_info", call_id=9))
    ctl.handle(ControlReply("server_info", wires.replicas[0][-1].call_id, {"stats": _stats()}))
    dead = wires.tm[-1].payload["replicas"][1]
    assert dead["alive"] is False and "code -9" in dead["error"] and dead["stats"] is None


def test_total_stats_sums_counts_and_recomputes_ratios():
    total = total_stats(
        {
            0: _stats(token_usage=0.5, prompt_tokens_total=10, cached_tokens_total=5, free_tokens=50),
            1: _stats(token_usage=0.0, prompt_tokens_total=30, memory_invariant_ok=False, memory_error="rows"),
        }
    )
    assert total["decode_tokens_per_s"] is None  # neither replica has decoded
    rates = total_stats({0: _stats(decode_tokens_per_s=None), 1: _stats(decode_tokens_per_s=80.0)})
    assert rates["decode_tokens_per_s"] == 80.0
    assert total["token_usage"] == 0.25 and total["cache_hit_rate"] == 5 / 40
    assert total["max_total_tokens"] == 200 and total["free_tokens"] == 150
    assert total["memory_invariant_ok"] is False and total["memory_error"] == "replica 1: rows"
    with pytest.raises(TypeError, match="new_ratio"):
        total_stats({0: _stats(new_ratio=0.5)})


# ---- real replicas ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[list[int]]:
    """dp=1's greedy tokens (the shared offline Engine)."""
    return [out["output_ids"] for out in engine.generate(PROMPTS, GREEDY)]


def _info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/get_server_info", timeout=30).json()


def _generate(url: str, text: str, **params: Any) -> dict[str, Any]:
    body = {"text": text, "sampling_params": {**GREEDY, **params}}
    response = httpx.post(url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _assert_spread_and_equal(url: str, reference: list[list[int]]) -> None:
    """Concurrent requests: the tokens are dp=1's, and both replicas served some,
    as the per-replica metrics and /get_server_info show."""
    before = [metric(url, "radixserve:replica_requests_dispatched_total", dp_rank=str(k)) for k in (0, 1)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda text: _generate(url, text), PROMPTS))
    assert [out["output_ids"] for out in outs] == reference
    for k in (0, 1):
        dispatched = metric(url, "radixserve:replica_requests_dispatched_total", dp_rank=str(k))
        assert dispatched > before[k], f"replica {k} got none of the requests"
        assert metric(url, "radixserve:replica_generation_tokens_total", dp_rank=str(k)) > 0
        assert metric(url, "radixserve:replica_up", dp_rank=str(k)) == 1
    info = _info(url)
    assert info["dp_size"] == 2 and all(r["stats"]["generation_tokens_total"] > 0 for r in info["replicas"])
    assert info["stats"]["generation_tokens_total"] == sum(
        r["stats"]["generation_tokens_total"] for r in info["replicas"]
    )


def _both_running(url: str) -> bool:
    return all(r["stats"] and r["stats"]["num_running_reqs"] > 0 for r in _info(url)["replicas"])


def test_engine_dp2_shortest_queue_gives_each_replica_its_share_of_the_cores(tiny_llama_dir, reference, monkeypatch):
    """Besides the policy: started by the runtime, each replica's model process runs the share
    of threads the platform gave it (two of one thread per core each were 5x slower on 2 cores)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with Engine(
        model_path=str(tiny_llama_dir),
        dp_size=2,
        load_balance_method="shortest_queue",
        max_total_tokens=4096,
        log_level="warning",
        backend_selection=PRIORITY,
    ) as eng:
        assert [out["output_ids"] for out in eng.generate(PROMPTS, GREEDY)] == reference
        info = eng.server_info()
        assert info["load_balance_method"] == "shortest_queue"
        assert [r["requests_dispatched_total"] > 0 for r in info["replicas"]] == [True, True]
        assert eng.flush_cache()
        for replica in eng.server_info()["replicas"]:
            stats = replica["stats"]
            assert stats["cached_tokens_in_tree"] == 0 and stats["free_tokens"] == stats["max_total_tokens"]
    share = CpuPlatform.process_environment(2)["OMP_NUM_THREADS"]
    assert f"OMP_NUM_THREADS={share}" in info["device"], info["device"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    """Two replicas behind minimum_tokens (the Engines here cover shortest_queue and the default,
    round_robin). The module's last test kills replica 1."""
    with serving(
        tiny_llama_dir,
        "--dp-size",
        "2",
        "--load-balance-method",
        "minimum_tokens",
        "--max-total-tokens",
        "4096",
        "--backend-selection",
        PRIORITY,
    ) as srv:
        yield srv


def test_minimum_tokens_spreads_with_dp1_tokens(server, reference):
    _assert_spread_and_equal(server.url, reference)
    assert _info(server.url)["load_balance_method"] == "minimum_tokens"


def test_abort_and_flush_span_replicas(server):
    """Long requests on both replicas, aborted by rid: each ends as an abort and
    the whole pool comes back on each replica."""
    url = server.url
    rids = [f"dp-abort-{i}" for i in range(4)]

    def run(rid: str) -> dict[str, Any]:
        body = {"text": "keep going", "rid": rid, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
        return httpx.post(url + "/generate", json=body, timeout=120).json()

    with ThreadPoolExecutor(len(rids)) as pool:
        futures = [pool.submit(run, rid) for rid in rids]
        assert wait_until(lambda: _both_running(url), 60), _info(url)
        for rid in rids:
            assert httpx.post(url + "/abort_request", json={"rid": rid}, timeout=30).status_code == 200
        outs = [f.result() for f in futures]
    assert [out["meta_info"]["finish_reason"]["type"] for out in outs] == ["abort"] * 4
    assert all(len(out["output_ids"]) < LONG for out in outs)
    for k in (0, 1):
        assert_whole_pool_back(ReplicaPool(url, k))
    assert_whole_pool_back(ServerPool(url))


def test_a_dead_replica_fails_its_requests_and_the_other_serves_on(server, reference):
    """On the module's server, after its other tests (it leaves the server one replica):
    both replicas served (checked again here), then replica 1 is killed mid-answer."""
    srv, url = server, server.url
    _assert_spread_and_equal(url, reference)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    results: list[Any] = [None] * 4
    long = {"model": "tiny", "prompt": "keep going", "max_tokens": LONG, "extra_body": {"ignore_eos": True}}

    def run(i: int) -> None:
        try:
            if i % 2:
                results[i] = client.completions.create(**long).choices[0].finish_reason
            else:
                results[i] = [c.choices[0].finish_reason for c in client.completions.create(stream=True, **long)][-1]
        except openai.APIError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert wait_until(lambda: _both_running(url), 60), _info(url)
    os.kill(_info(url)["pids"]["scheduler-dp1"], signal.SIGKILL)
    for t in threads:
        t.join(120)
    failed = [r for r in results if isinstance(r, Exception)]
    assert failed and len(failed) < 4, results  # replica 1's requests, and only those
    for exc in failed:
        assert "data-parallel replica 1 died" in str(exc), exc
        assert isinstance(exc, openai.InternalServerError) or exc.__class__ is openai.APIError
    assert all(r == "length" for r in results if not isinstance(r, Exception)), results

    dead = _info(url)["replicas"][1]
    assert dead["alive"] is False and "scheduler-dp1 exited with code -9" in dead["error"]
    assert metric(url, "radixserve:replica_up", dp_rank="1") == 0
    for _ in range(2):  # new requests go to the live replica
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=4).choices[0].text is not None
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert "data-parallel replica 1 is down" in srv.log
    assert_whole_pool_back(ReplicaPool(url, 0))
    client.close()


def test_engine_dp2_tp2_composes(tiny_llama_dir, reference, monkeypatch):
    """Two replicas of two tensor-parallel ranks each: four scheduler processes in
    two process groups, each meeting at its own store; greedy tokens equal dp=1 tp=1."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited: four ranks share the machine's cores
    with Engine(
        model_path=str(tiny_llama_dir),
        dp_size=2,
        tp_size=2,
        max_total_tokens=4096,
        log_level="warning",
        backend_selection=PRIORITY,
    ) as eng:
        assert [out["output_ids"] for out in eng.generate(PROMPTS, GREEDY)] == reference
        info = eng.server_info()
        assert info["load_balance_method"] == "round_robin"  # the default
        assert info["tp_size"] == 2 and [r["requests_dispatched_total"] > 0 for r in info["replicas"]] == [True, True]
