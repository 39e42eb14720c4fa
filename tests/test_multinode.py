"""Several nodes on 127.0.0.1: node 0 serves HTTP and runs rank 0, node 1 runs
rank 1 only. Two nodes started with --nnodes/--node-rank/--dist-init-addr, and
two started by torchrun (its environment places them), answer as tp=1 does;
SIGTERM on node 0 stops both nodes with exit code 0; a rank killed mid-run ends
every request in flight with an error event, and both nodes exit non-zero with
the reason and leave no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
from pathlib import Path

import httpx
import pytest
from generation_utils import generate, make_scheduler, mixed_prompts
from helpers_server import ServerProcess, process_alive, wait_until

ENV = {"OMP_NUM_THREADS": "1"}  # two nodes' ranks share the machine's cores
COMMON = ("--tp-size", "2", "--dtype", "float32", "--max-total-tokens", "8192", "--backend-selection", "priority")
NEW_TOKENS = 8
_NODE_READY = re.compile(r"radixserve node 1 ready: scheduler-tp1 \(pid (\d+)\)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model(tiny_llama_dir) -> Path:
    return tiny_llama_dir


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    return mixed_prompts(256, [5, 17, 40], seed=11, shared_prefix=8)


@pytest.fixture(scope="module")
def reference(model, prompts) -> list[list[int]]:
    """tp=1 greedy tokens, in this process."""
    scheduler = make_scheduler(model, dtype="float32")
    return [r.output_ids for r in generate(scheduler, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)]


def _generate(url: str, prompts: list[list[int]]) -> list[list[int]]:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    answer = httpx.post(url + "/generate", json={"input_ids": prompts, "sampling_params": params}, timeout=120)
    assert answer.status_code == 200, answer.text
    return [item["output_ids"] for item in answer.json()]


def _node1_rank_pid(node1: ServerProcess) -> int:
    assert wait_until(lambda: _NODE_READY.search(node1.log), timeout=120), node1.log
    return int(_NODE_READY.search(node1.log).group(1))


def _stream(url: str, outcomes: list[dict]) -> None:
    body = {"model": "m", "prompt": "count", "max_tokens": 900, "ignore_eos": True, "stream": True}
    outcome: dict = {}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            outcome["status"] = response.status_code
            if response.status_code == 200:
                outcome["events"] = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            else:  # ended before its first token: the error envelope instead of a stream
                outcome["error"] = json.loads(response.read())["error"]["message"]
    except httpx.HTTPError as exc:  # a cut connection: what must never happen
        outcome["transport_error"] = repr(exc)
    outcomes.append(outcome)


def test_two_nodes_equal_tp1_and_a_killed_rank_ends_both_in_order(model, prompts, reference):
    addr = f"127.0.0.1:{_free_port()}"
    nodes = ("--model", str(model), "--served-model-name", "m", *COMMON, "--nnodes", "2", "--dist-init-addr", addr)
    with (
        ServerProcess(*nodes, "--node-rank", "1", env=ENV) as node1,
        ServerProcess(*nodes, "--node-rank", "0", env=ENV) as node0,
    ):
        url = node0.wait_ready()
        rank1 = _node1_rank_pid(node1)
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        assert info["tp_size"] == 2 and set(info["pids"]) == {"scheduler-tp0", "detokenizer"}
        assert _generate(url, prompts) == reference

        outcomes: list[dict] = []
        threads = [threading.Thread(target=_stream, args=(url, outcomes)) for _ in range(3)]
        for t in threads:
            t.start()
        assert wait_until(
            lambda: httpx.get(url + "/get_server_info", timeout=30).json()["num_in_flight"] >= 3, timeout=60
        ), "the requests never started"
        os.kill(rank1, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert node0.wait_exit(timeout=60) == 1, node0.log
        assert node1.wait_exit(timeout=60) == 1, node1.log
    assert len(outcomes) == 3
    for outcome in outcomes:  # an error event, then [DONE] (or a 503 envelope); never a cut connection
        assert "transport_error" not in outcome, outcome
        if outcome["status"] == 200:
            events = outcome["events"]
            assert events[-1] == "[DONE]", outcome
            message = json.loads(events[-2])["error"]["message"]
        else:
            assert outcome["status"] == 503, outcome
            message = outcome["error"]
        assert "the runtime is down" in message, outcome
    assert re.search(r"a runtime process died \(scheduler-tp0 exited with code 1\)", node0.log), node0.log
    assert "radixserve: error: node 1: scheduler-tp1 exited with code -9" in node1.log, node1.log
    pids = [*info["pids"].values(), rank1]
    assert wait_until(lambda: not any(process_alive(pid) for pid in pids), timeout=10), "orphaned processes"


def _torchrun(node_rank: int, port: int) -> list[str]:
    return [
        sys.executable,
        *("-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank)),
        *("--master-addr", "127.0.0.1", "--master-port", str(port), "-m"),
    ]


def test_torchrun_places_two_nodes_equal_tp1_and_sigterm_stops_both(model, prompts, reference):
    port = _free_port()
    args = ("--model", str(model), *COMMON)
    with (
        ServerProcess(*args, env=ENV, launcher=_torchrun(1, port)) as node1,
        ServerProcess(*args, env=ENV, launcher=_torchrun(0, port)) as node0,
    ):
        url = node0.wait_ready()
        _node1_rank_pid(node1)
        assert "placed by the launcher's environment: --nnodes 2 --node-rank 0" in node0.log
        assert _generate(url, prompts) == reference
        server_pid = int(re.search(r"Started server process \[(\d+)\]", node0.log).group(1))
        os.kill(server_pid, signal.SIGTERM)  # the server under torchrun drains and stops the group
        assert node0.wait_exit(timeout=60) == 0, node0.log
        assert node1.wait_exit(timeout=60) == 0, node1.log
    assert "node 0 shut the group down" in node1.log, node1.log
