"""The server's life: 503 while starting and 200 once ready, the built-in demo
model when no --model is given, a clean exit when a runtime process dies, and
a clear failure for a model that does not exist."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import openai
import pytest
from helpers_server import PRIORITY_BACKENDS, ServerProcess, process_alive, wait_until


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """`radixserve serve` with no --model: builds the demo model into a fresh cache."""
    cache = tmp_path_factory.mktemp("radixserve-cache")
    env = {"RADIXSERVE_CACHE_DIR": str(cache)}
    with ServerProcess("--max-total-tokens", "8192", *PRIORITY_BACKENDS, env=env) as srv:
        yield srv


def test_health_is_503_while_starting_then_200(demo_server):
    url = demo_server.wait_listening()
    starting = httpx.get(url + "/health", timeout=30)
    assert starting.status_code == 503 and "starting" in starting.json()["error"]["message"]
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30).status_code == 503
    demo_server.wait_ready()
    assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_demo_model_serves_and_says_so(demo_server):
    url = demo_server.wait_ready()
    assert "demo model" in demo_server.log and "RANDOM weights" in demo_server.log
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        assert [m.id for m in client.models.list().data] == ["radixserve-demo"]
        out = client.chat.completions.create(
            model="radixserve-demo", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert out.usage.completion_tokens <= 4
    info = httpx.get(url + "/get_model_info", timeout=30).json()
    assert info["context_length"] == 2048 and info["architecture"] == "LlamaForCausalLM"


def test_child_death_stops_the_server_cleanly(demo_server):
    """Runs last in the module: it kills the server."""
    url = demo_server.wait_ready()
    pids = httpx.get(url + "/get_server_info", timeout=30).json()["pids"]
    os.kill(pids["scheduler"], signal.SIGKILL)
    code = demo_server.wait_exit(timeout=20)
    assert code is not None, "the server kept running after its scheduler died"
    assert code != 0
    assert "scheduler exited with code -9" in demo_server.log, demo_server.log
    assert wait_until(lambda: not process_alive(pids["detokenizer"]), timeout=10), "orphaned detokenizer"


def test_missing_model_fails_fast_with_a_clear_error(tmp_path):
    with ServerProcess("--model", str(tmp_path / "nope")) as srv:
        code = srv.wait_exit(timeout=120)
        assert code == 1, srv.log
        assert "is not a directory" in srv.log


def test_a_demo_model_that_cannot_be_built_fails_the_start_and_leaves_no_process(tmp_path):
    """The demo model's first build runs while its model process, spawned held,
    imports: a build that fails ends the start with an error, and the held process
    with it."""
    (tmp_path / "a-file").write_text("")
    cache = str(tmp_path / "a-file" / "cache")  # no directory can be made there
    with ServerProcess(*PRIORITY_BACKENDS, env={"RADIXSERVE_CACHE_DIR": cache}) as srv:
        assert srv.wait_exit(timeout=120) == 1, srv.log
        assert "startup failed" in srv.log and "Not a directory" in srv.log, srv.log
    assert wait_until(lambda: not _processes_with_env("RADIXSERVE_CACHE_DIR", cache), timeout=10)


def _processes_with_env(name: str, value: str) -> list[int]:
    """The pids of this machine's processes whose environment sets ``name`` to ``value``."""
    wanted, found = f"{name}={value}".encode(), []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and wanted in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found
