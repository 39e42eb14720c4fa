"""The router's own CPU per forwarded request, and where it goes.

One worker (the built-in demo model, or ``--model``) and ``radixserve router`` in front
of it; ``--requests`` small completions (one output token) at ``--concurrency``. The
router process's CPU time (user + sys, from /proc) over the run, divided by the
requests: unlike latency, it hardly moves with other load on the machine. With
``--py-spy FILE`` the router is sampled while it serves (py-spy's raw format) and the
functions holding most of its CPU are printed. With ``--smg COMMAND`` SGLang's gateway
(cache_aware) stands in front of the worker instead, measured the same way.

    python benchmarks/profile_router.py --requests 600 --concurrency 16 [--stream] [--py-spy /tmp/router.raw]
    python benchmarks/profile_router.py --requests 600 --concurrency 16 --smg "$(which smg)"
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx

READY = re.compile(r"radixserve (?:router )?ready at (\S+)")


def start(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    out = open(log, "w")  # noqa: SIM115 (held for the process's life)
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve.cli", *args, "--port", "0"],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        match = READY.search(log.read_text(errors="replace"))
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"{args[0]} not ready in 600 s")


def start_smg(command: str, worker_url: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """SGLang's gateway in front of ``worker_url``; ready once it lists the worker's model."""
    port, metrics_port = free_port(), free_port()
    args = ["launch", "--worker-urls", worker_url, "--policy", "cache_aware", "--log-level", "warn"]
    args += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port)]
    out = open(log, "w")  # noqa: SIM115 (held for the process's life)
    proc = subprocess.Popen([command, *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).json().get("data"):
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError("smg not ready in 120 s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, requests: int, concurrency: int, stream: bool) -> list[float]:
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            body = {"model": "bench", "prompt": f"hello {i} world", "max_tokens": 1, "stream": stream}
            async with gate:
                start = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one(i) for i in range(requests)))
    return sorted(latencies)


def top_functions(raw: Path, count: int) -> list[tuple[float, str]]:
    """Inclusive share of the samples per function (a function counted once per stack)."""
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        total += int(samples)
        for frame in set(stack.split(";")):
            inclusive[frame] += int(samples)
    return [(100 * n / total, frame) for frame, n in inclusive.most_common(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="worker model directory ('' for the demo model)")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--py-spy", type=Path, default=None, help="write py-spy's raw samples of the router here")
    p.add_argument("--smg", default=None, help="profile SGLang's gateway (this command) instead of ours")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/profile-router"))
    ns = p.parse_args()
    ns.log_dir.mkdir(parents=True, exist_ok=True)
    model = ["--model", ns.model] if ns.model else []
    worker, worker_url = start(["serve", *model, "--served-model-name", "bench"], ns.log_dir / "worker.log")
    procs = [worker]
    try:
        if ns.smg:
            router, url = start_smg(ns.smg, worker_url, ns.log_dir / "smg.log")
        else:
            # At warning level, as smg runs here (--log-level warn): no log line per request.
            router, url = start(
                ["router", "--worker-urls", worker_url, "--log-level", "warning"], ns.log_dir / "router.log"
            )
        procs.append(router)
        asyncio.run(drive(url, 50, ns.concurrency, ns.stream))  # connections and caches warm
        spy = None
        if ns.py_spy:
            spy = subprocess.Popen(
                ["py-spy", "record", "-p", str(router.pid), "-f", "raw", "-o", str(ns.py_spy), "-r", "200"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1)
        before, started = cpu_seconds(router.pid), time.perf_counter()
        latencies = asyncio.run(drive(url, ns.requests, ns.concurrency, ns.stream))
        used, wall = cpu_seconds(router.pid) - before, time.perf_counter() - started
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        result = {
            "router": "smg" if ns.smg else "radixserve",
            "router_cpu_ms_per_request": round(1000 * used / ns.requests, 3),
            "requests": ns.requests,
            "concurrency": ns.concurrency,
            "stream": ns.stream,
            "wall_s": round(wall, 2),
            "latency_p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
        }
        print(json.dumps(result))
        if ns.py_spy:
            for share, frame in top_functions(ns.py_spy, 30):
                print(f"{share:5.1f}%  {frame}")
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)


if __name__ == "__main__":
    main()
