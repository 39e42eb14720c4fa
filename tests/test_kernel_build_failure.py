"""The CPU kernels without a compiler, and a compile that fails.

The installation holds them compiled (setup.py), so a server on a machine with no
C++ compiler serves with them. Where they are compiled on first use
(``RADIXSERVE_CPU_KERNELS=native`` here), there is no hidden compile at the first
request: the server builds them before it says it is listening, and a build that
fails (a broken compiler on PATH) makes ``auto`` pass over the backends that need
them, saying why, while the server still serves."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx
from helpers_server import ServerProcess

from radixserve_torch import cpu_isa
from radixserve_torch.cpu_kernel_build import installed_library

BROKEN_CXX = """#!/bin/sh
echo "broken-c++: error: this compiler is broken on purpose" >&2
exit 1
"""


def serve_one_request(model_dir: Path, env: dict[str, str]) -> tuple[ServerProcess, dict, dict]:
    """A server on ``model_dir`` with ``env``, backends by priority (auto times none of
    them); its server info and its answer to one greedy request, and the stopped server."""
    args = ("--model", str(model_dir), "--max-total-tokens", "4096", "--backend-selection", "priority")
    with ServerProcess(*args, env=env) as server:
        url = server.wait_ready()
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        reply = httpx.post(
            f"{url}/generate",
            json={
                "input_ids": [5, 6, 7],
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            },
            timeout=60,
        ).json()
    return server, info, reply


def test_a_broken_compiler_passes_the_cpu_kernels_over_and_the_server_serves(tiny_llama_dir, tmp_path):
    cxx = tmp_path / "broken-c++"
    cxx.write_text(BROKEN_CXX)
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    env = {
        "CXX": str(cxx),
        "RADIXSERVE_CPU_KERNELS": "native",  # compiled for this CPU on first use, not loaded from the installation
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),  # nothing built there yet
        "RADIXSERVE_CACHE_DIR": str(tmp_path / "cache"),
    }
    assert not os.path.exists(env["TORCH_EXTENSIONS_DIR"])
    # auto passes over the backends that need the kernels.
    server, info, reply = serve_one_request(tiny_llama_dir, env)
    lines = server.lines
    listening = next(i for i, line in enumerate(lines) if "listening at" in line)
    passed_over = [i for i, line in enumerate(lines) if "is passed over: build failed" in line]
    # Found before the server said it was listening, once per backend that needs the kernels.
    assert passed_over and max(passed_over) < listening, server.log
    assert {
        kind for kind in ("gemm", "attention", "elementwise") if any(f"{kind} backend" in lines[i] for i in passed_over)
    } == {"gemm", "attention", "elementwise"}
    assert all(str(cxx) in lines[i] for i in passed_over), server.log  # the reason names the compiler that failed
    backends = info["backends"]
    assert backends["gemm"] != "cpu_packed" and backends["attention"] != "cpu_paged"
    assert backends["elementwise"] != "cpu_fused", backends
    assert len(reply["output_ids"]) == 4


def test_without_a_compiler_the_server_serves_with_the_installations_kernels(tiny_llama_dir, tmp_path):
    target = cpu_isa.build_target()
    assert target is not None and target.shipped, target
    library = installed_library(target.name, target.cflags)
    assert library is not None, "install with the README's command: setup.py compiles the kernels"
    env = {
        "CXX": str(tmp_path / "no-such-c++"),
        "PATH": str(tmp_path),  # no compiler, no ninja (the server is started by path)
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),  # and no earlier build of them
        "RADIXSERVE_CACHE_DIR": str(tmp_path / "cache"),
    }
    server, info, reply = serve_one_request(tiny_llama_dir, env)
    backends = info["backends"]
    assert not os.path.exists(env["TORCH_EXTENSIONS_DIR"])  # nothing was compiled
    assert f"CPU kernels for {target.origin} ready" in server.log and str(library) in server.log
    assert "passed over" not in server.log, server.log
    assert (backends["attention"], backends["elementwise"]) == ("cpu_paged", "cpu_fused"), backends
    assert len(reply["output_ids"]) == 4
