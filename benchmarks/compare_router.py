"""radixserve router against SGLang's model gateway (``smg`` 0.3.2 and 1.13) on small fleets.

For each fleet shape, three workers of one model are started (each ``--served-model-name
bench``, ``OMP_NUM_THREADS=1``, a fixed ``--max-total-tokens``):

- ``equal``: three default workers;
- ``weak``: two default workers and one limited to 2 running requests and 64-token
  prefill chunks (``--max-running-requests 2 --chunked-prefill-size 64``);
- ``slow``: two default workers and one several times slower: its elementwise kernels
  are Triton's, run by the interpreter (``TRITON_INTERPRET=1 --elementwise-backend
  triton``; on the benchmark model about 3.5x slower at prefill and 8x at decode; the
  torch reference backends are only 2-2.7x slower). Every run starts with every cache
  flushed, so the slow worker joins each run cold, as the others do.

Each worker's speed is measured once it is up (one 512-token prefill, one 64-token
decode, alone) and recorded. Then for each workload, ``--repeats`` times, each router in
turn (the order rotated each repeat): flush every worker's cache, warm every worker with
one direct request, start the router (a fresh process), wait until it lists the three
workers, send a few warm-up requests through it, then the workload (``radixserve bench
serving``, a fixed seed):

- ``shared-prefix``: groups of requests sharing a system prompt
  (``--dataset generated-shared-prefix``);
- ``long-prompts``: no sharing, long random prompts (``--dataset random``).

Recorded per run: output tok/s, TTFT p50/p99, the fleet's cache hit rate (the workers'
cached over prompt tokens, deltas over the run), and each worker's requests and prompt
tokens (deltas of its counters). Printed per shape and workload: each router's median
and spread (min-max) over the repeats, the equal workers' share spread (prompt tokens:
largest over smallest, less one), and the issue's goals checked against smg's best.

Router overhead, each router in front of one default worker alone: latency of small
requests (one output token) at concurrency 1, and the requests/s ceiling at high
concurrency, against the same requests sent to the worker directly.

smg 0.3.2 is the ``smg`` on PATH (``pip install sglang-router==0.3.2``); smg 1.13 lives in
its own environment (it installs an ``smg`` command too)::

    python -m venv ~/.venvs/smg113 && ~/.venvs/smg113/bin/pip install smg==1.13.0
    python benchmarks/compare_router.py --smg-1-13 ~/.venvs/smg113/bin/smg --out-dir /tmp/cr

Prints markdown tables and writes every number as JSON (``--out-dir``). Every process
started here (workers, routers, the client) is stopped on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = Path.home() / ".cache/radixserve-bench/models/llama"
SERVED_NAME = "bench"
READY_WORKER = re.compile(r"radixserve ready at (\S+)")
READY_ROUTER = re.compile(r"radixserve router ready at (\S+)")
# KIND:POLICY; the smg kinds are the two gateway versions (--smg-0-3-2, --smg-1-13).
ROUTERS = ("smg-0.3.2:cache_aware", "smg-1.13:cache_aware", "smg-1.13:least_load", "radixserve:latency_aware")
SMG_KINDS = ("smg-0.3.2", "smg-1.13")
# Each router kind's default policy, for the overhead part (one worker: the policy is moot).
OVERHEAD_ROUTERS = ("smg-0.3.2:cache_aware", "smg-1.13:cache_aware", "radixserve:latency_aware")
# name -> the workers of that fleet shape: (name, extra serve flags, extra environment); equal
# workers' names share the part before the dash.
SHAPES: dict[str, list[tuple[str, list[str], dict[str, str]]]] = {
    "equal": [("cpu-a", [], {}), ("cpu-b", [], {}), ("cpu-c", [], {})],
    "weak": [
        ("cpu-a", [], {}),
        ("cpu-b", [], {}),
        ("weak", ["--max-running-requests", "2", "--chunked-prefill-size", "64"], {}),
    ],
    "slow": [
        ("cpu-a", [], {}),
        ("cpu-b", [], {}),
        ("slow", ["--elementwise-backend", "triton"], {"TRITON_INTERPRET": "1"}),
    ],
}
WORKLOADS = ("shared-prefix", "long-prompts")


# ---- processes ---------------------------------------------------------------------------
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Processes:
    """Starts processes in their own session and stops each one it started (its process
    group: a worker's scheduler subprocesses go with it), newest first, whatever happens."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.log_dir / f"{name}.log"
        with open(log, "w") as out:
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            popen = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, timeout: float = 30.0) -> None:
        if proc in self.procs:
            self.procs.remove(proc)
        if proc.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGTERM)
            try:
                proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
        # The group may outlive its leader (children still exiting): make sure it is gone.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.popen.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)

    def wait_for_line(self, proc: Proc, pattern: re.Pattern, timeout: float) -> str:
        """The first group of ``pattern``'s first match in the process's output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = pattern.search(proc.log.read_text(errors="replace"))
            if match:
                return match.group(1)
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
            time.sleep(0.5)
        raise RuntimeError(f"{proc.name}: no {pattern.pattern!r} in {timeout:.0f} s:\n{proc.tail()}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- workers -----------------------------------------------------------------------------
@dataclass
class Worker:
    name: str
    url: str
    backends: dict[str, Any] = field(default_factory=dict)
    speed: dict[str, float] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """Workers of one kind are equal (``cpu-a``, ``cpu-b``: ``cpu``)."""
        return self.name.split("-")[0]


def start_workers(ns: argparse.Namespace, shape: str, procs: Processes) -> list[Worker]:
    model = ["--model", ns.model] if ns.model else []
    started = []
    for name, flags, env in SHAPES[shape]:
        cmd = ["radixserve", "serve", *model, "--served-model-name", SERVED_NAME, "--port", "0"]
        cmd += ["--max-total-tokens", str(ns.max_total_tokens), *flags]
        started.append((name, procs.start(f"{shape}-worker-{name}", cmd, {"OMP_NUM_THREADS": "1", **env})))
    workers = []
    for name, proc in started:
        url = procs.wait_for_line(proc, READY_WORKER, ns.startup_timeout)
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        workers.append(Worker(name, url, info.get("backends") or {}))
    for worker in workers:  # one at a time: each alone on the machine
        worker.speed = measure_speed(worker.url)
        print(f"worker {worker.name} at {worker.url}: {worker.backends}; {worker.speed}", flush=True)
    return workers


def measure_speed(url: str) -> dict[str, float]:
    """Prefill tok/s of one 512-token prompt and decode tok/s of 64 output tokens, alone."""
    prompt = list(range(100, 612))
    body: dict[str, Any] = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    httpx.post(url + "/v1/completions", json={**body, "prompt": prompt[:16]}, timeout=600).raise_for_status()
    started = time.perf_counter()
    httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
    prefill_s = time.perf_counter() - started
    short = {**body, "prompt": prompt[:8], "max_tokens": 65, "ignore_eos": True}
    started = time.perf_counter()
    httpx.post(url + "/v1/completions", json=short, timeout=600).raise_for_status()
    decode_s = time.perf_counter() - started
    httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
    return {"prefill_tokens_per_s": round(len(prompt) / prefill_s, 1), "decode_tokens_per_s": round(64 / decode_s, 1)}


def worker_counters(url: str) -> dict[str, float]:
    """Prompt and cached token totals (the scheduler's stats) and requests served (/metrics)."""
    stats = httpx.get(url + "/get_server_info", timeout=30).json()["stats"]
    requests = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("radixserve:num_requests_total{"):
            requests += float(line.rsplit(" ", 1)[1])
    return {
        "prompt_tokens": stats["prompt_tokens_total"],
        "cached_tokens": stats["cached_tokens_total"],
        "requests": requests,
        "generation_tokens": stats["generation_tokens_total"],
    }


def flush_and_warm(workers: list[Worker], prompt: str) -> None:
    """Empty every prefix cache, then one direct request each, so that each worker has
    measured rates (latency_aware reads them) and identical state for every router."""
    for worker in workers:
        response = httpx.post(worker.url + "/flush_cache", timeout=60)
        response.raise_for_status()
    for worker in workers:
        body = {"model": SERVED_NAME, "prompt": f"{prompt} ({worker.name})", "max_tokens": 16, "ignore_eos": True}
        httpx.post(worker.url + "/v1/completions", json=body, timeout=600).raise_for_status()


# ---- routers -----------------------------------------------------------------------------
def start_router(
    spec: str, urls: list[str], procs: Processes, timeout: float, smg_bins: dict[str, str]
) -> tuple[Proc, str]:
    """``spec``: ``KIND:POLICY`` (KIND one of ``SMG_KINDS`` or ``radixserve``); returns once
    it lists every worker as healthy (ours: and has read each one's load)."""
    kind, policy = spec.split(":")
    name = f"router-{kind}-{policy}-{len(urls)}w-{time.monotonic_ns()}"
    if kind in SMG_KINDS:
        port = free_port()
        cmd = [smg_bins[kind], "launch", "--worker-urls", *urls, "--policy", policy, "--log-level", "warn"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
        proc = procs.start(name, cmd)
        url = f"http://127.0.0.1:{port}"
    else:
        # At warning level, as smg runs here: no log line per request (about 0.03 ms of CPU each).
        cmd = ["radixserve", "router", "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1"]
        cmd += ["--log-level", "warning"]
        proc = procs.start(name, [*cmd, "--port", "0"])
        url = procs.wait_for_line(proc, READY_ROUTER, timeout)
    deadline = time.monotonic() + timeout
    while not _lists_workers(url, kind, len(urls)):
        if not proc.alive():
            raise RuntimeError(f"{name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not list {len(urls)} healthy workers in {timeout:.0f} s:\n{proc.tail()}")
        time.sleep(0.5)
    return proc, url


def _lists_workers(url: str, kind: str, count: int) -> bool:
    try:
        workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False
    if len(workers) != count:
        return False
    if kind in SMG_KINDS:
        return all(w.get("is_healthy") for w in workers)
    return all(w["healthy"] and w["load"]["decode_tokens_per_s"] for w in workers)


def smg_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True)
    return (out.stdout or out.stderr).strip()


# ---- clients -----------------------------------------------------------------------------
def run_bench_serving(
    ns: argparse.Namespace, workload: str, url: str, tokenizer: str, label: str, out_file: Path, procs: Processes
) -> dict[str, Any]:
    """One ``radixserve bench serving`` run of ``workload``; its JSON line."""
    cmd = ["radixserve", "bench", "serving", "--base-url", url, "--model", SERVED_NAME, "--tokenizer", tokenizer]
    cmd += ["--prompt-format", "text", "--seed", str(ns.seed), "--request-rate", str(ns.request_rate)]
    if workload == "shared-prefix":
        cmd += ["--dataset", "generated-shared-prefix", "--gsp-num-groups", str(ns.gsp_num_groups)]
        cmd += ["--gsp-prompts-per-group", str(ns.gsp_prompts_per_group)]
        cmd += [
            "--gsp-system-prompt-len",
            str(ns.gsp_system_prompt_len),
            "--gsp-question-len",
            str(ns.gsp_question_len),
        ]
        cmd += ["--gsp-output-len", str(ns.output_len)]
    else:
        cmd += ["--dataset", "random", "--num-prompts", str(ns.long_prompts)]
        cmd += ["--random-input-len", str(ns.long_prompt_len), "--random-range-ratio", str(ns.long_range_ratio)]
        cmd += ["--random-output-len", str(ns.output_len)]
    cmd += ["--warmup-requests", "0", "--disable-tqdm", "--label", label, "--output-file", str(out_file)]
    if ns.max_concurrency:
        cmd += ["--max-concurrency", str(ns.max_concurrency)]
    before = out_file.read_text().count("\n") if out_file.exists() else 0
    proc = procs.start(f"bench-{label}", cmd)
    try:
        code = proc.popen.wait(ns.run_timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"bench {label} ran over {ns.run_timeout} s:\n{proc.tail()}") from None
    finally:
        procs.stop(proc)
    lines = out_file.read_text().splitlines() if out_file.exists() else []
    if len(lines) <= before:
        raise RuntimeError(f"bench {label} exited {code} without a result:\n{proc.tail()}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


async def _small_requests(url: str, count: int, concurrency: int, prompt: str) -> dict[str, Any]:
    """``count`` non-streaming completions of one token at ``concurrency``: latencies and rate."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    latencies: list[float] = []
    errors: list[str] = []
    queue = iter(range(count))

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def loop() -> None:
            for _ in queue:
                started = time.perf_counter()
                try:
                    response = await client.post("/v1/completions", json=body)
                    response.raise_for_status()
                    latencies.append(time.perf_counter() - started)
                except httpx.HTTPError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")

        for _ in range(min(8, count)):  # connections and code paths warm, unmeasured
            await client.post("/v1/completions", json=body)
        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        duration = time.perf_counter() - started
    ms = sorted(x * 1000 for x in latencies)
    return {
        "requests": count,
        "concurrency": concurrency,
        "errors": len(errors),
        "first_errors": errors[:3],
        "duration_s": duration,
        "requests_per_s": len(latencies) / duration,
        "latency_ms_p50": statistics.median(ms) if ms else None,
        "latency_ms_p99": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))] if ms else None,
    }


def small_requests(url: str, count: int, concurrency: int, prompt: str) -> dict[str, Any]:
    return asyncio.run(_small_requests(url, count, concurrency, prompt))


def warm_router(url: str, count: int) -> None:
    """``count`` short requests through the router, on prompts of their own, one at a time."""
    for i in range(count):
        body = {"model": SERVED_NAME, "prompt": f"warm-up request {i}: hello", "max_tokens": 4, "ignore_eos": True}
        httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()


# ---- the runs ----------------------------------------------------------------------------
def fleet_run(
    ns: argparse.Namespace,
    spec: str,
    workload: str,
    workers: list[Worker],
    tokenizer: str,
    procs: Processes,
    out: Path,
    smg_bins: dict[str, str],
) -> dict[str, Any]:
    flush_and_warm(workers, "The quick brown fox jumps over the lazy dog")
    router, url = start_router(spec, [w.url for w in workers], procs, ns.startup_timeout, smg_bins)
    try:
        warm_router(url, ns.router_warmup)
        before = {w.name: worker_counters(w.url) for w in workers}
        cpu_before = process_cpu_s(router.popen.pid)
        started = time.monotonic()
        label = f"{workload}-{spec.replace(':', '-')}"
        result = run_bench_serving(ns, workload, url, tokenizer, label, out / "bench.jsonl", procs)
        wall = time.monotonic() - started
        router_cpu = process_cpu_s(router.popen.pid) - cpu_before
        after = {w.name: worker_counters(w.url) for w in workers}
        decisions = (
            placements(url, [w.name for w in workers], [w.url for w in workers])
            if spec.startswith("radixserve:")
            else []
        )
    finally:
        procs.stop(router)
    delta = {name: {k: after[name][k] - before[name][k] for k in after[name]} for name in after}
    prompt = sum(d["prompt_tokens"] for d in delta.values())
    cached = sum(d["cached_tokens"] for d in delta.values())
    return {
        "router": spec,
        "workload": workload,
        "completed": result["completed"],
        "failed": result["failed"],
        "errors": result["errors"],
        "duration_s": result["duration_s"],
        "wall_s": wall,
        "output_throughput": result["output_throughput"],
        "ttft_ms": result["ttft_ms"],
        "e2e_latency_ms": result["e2e_latency_ms"],
        "fleet_cache_hit_rate": cached / prompt if prompt else None,
        "worker_deltas": delta,
        "equal_share_spread": equal_share_spread(workers, delta),
        "router_cpu_s": router_cpu,
        "placements": decisions,
    }


def placements(url: str, names: list[str], urls: list[str]) -> list[dict[str, Any]]:
    """Our router's last decisions (``/debug/decisions``), each reduced to the worker chosen
    and every candidate's cached tokens and score terms (seconds), to explain the shares."""
    name_of = dict(zip(urls, names, strict=True))
    body = httpx.get(url + "/debug/decisions", params={"limit": 256}, timeout=30).json()
    terms = ("cached_tokens", "queued_prefill_tokens", "running_requests", "prefill_s", "imposed_s", "queueing_s")
    return [
        {
            "chosen": name_of.get(d["chosen"], d["chosen"]),
            "prompt_tokens": d["prompt_tokens"],
            "candidates": {
                name_of.get(c["worker"], c["worker"]): {t: c.get(t) for t in (*terms, "total_s")}
                for c in d["candidates"]
            },
        }
        for d in body["decisions"]
    ]


def process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def equal_share_spread(workers: list[Worker], delta: dict[str, dict[str, float]]) -> float | None:
    """Among the equal workers (the largest kind), the most prompt tokens one computed over
    the fewest another did, less one (0.15: within 15% of each other); None if one got none."""
    kinds: dict[str, list[float]] = {}
    for worker in workers:
        kinds.setdefault(worker.kind, []).append(delta[worker.name]["prompt_tokens"])
    shares = max(kinds.values(), key=len)
    return max(shares) / min(shares) - 1 if min(shares) > 0 else None


def overhead_runs(ns: argparse.Namespace, worker: Worker, procs: Processes, smg_bins: dict[str, str]) -> dict[str, Any]:
    """Each target ``--repeats`` times, the order rotated each time: {label: [result, ...]}."""
    prompt = "Say hello."
    specs = [spec for spec in OVERHEAD_ROUTERS if spec.split(":")[0] in smg_bins or spec.startswith("radixserve:")]
    targets: list[str] = ["direct", *specs]
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in targets}
    for repeat in range(ns.repeats):
        for label in targets[repeat % len(targets) :] + targets[: repeat % len(targets)]:
            router = None
            url = worker.url
            if label != "direct":
                router, url = start_router(label, [worker.url], procs, ns.startup_timeout, smg_bins)
            try:
                latency = small_requests(url, ns.latency_requests, 1, prompt)
                ceiling = small_requests(url, ns.ceiling_requests, ns.ceiling_concurrency, prompt)
            finally:
                if router:
                    procs.stop(router)
            results[label].append({"latency": latency, "ceiling": ceiling})
            print(
                f"overhead #{repeat} {label}: p50 {latency['latency_ms_p50']:.2f} ms, "
                f"p99 {latency['latency_ms_p99']:.2f} ms; ceiling {ceiling['requests_per_s']:.1f} req/s "
                f"({latency['errors'] + ceiling['errors']} errors)",
                flush=True,
            )
    return results


# ---- the report --------------------------------------------------------------------------
def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def median_spread(values: list[float | None], digits: int = 0, scale: float = 1.0) -> str:
    """``median [min-max]`` of the repeats."""
    known = [v * scale for v in values if v is not None]
    if not known:
        return "n/a"
    if len(known) == 1:
        return fmt(known[0], digits)
    return f"{fmt(statistics.median(known), digits)} [{fmt(min(known), digits)}-{fmt(max(known), digits)}]"


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per router: the median of each figure over its repeats."""
    by_router: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_router.setdefault(run["router"], []).append(run)

    def med(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    return {
        router: {
            "output_throughput": med([r["output_throughput"] for r in rs]),
            "ttft_p50": med([r["ttft_ms"]["median"] for r in rs]),
            "ttft_p99": med([r["ttft_ms"]["p99"] for r in rs]),
            "hit": med([r["fleet_cache_hit_rate"] for r in rs]),
            "equal_share_spread": med([r["equal_share_spread"] for r in rs]),
            "failed": sum(r["failed"] for r in rs),
        }
        for router, rs in by_router.items()
    }


def goals(summary: dict[str, dict[str, Any]], ours: str) -> list[str]:
    """The issue's goals for ``ours`` against smg's best (medians over the repeats)."""
    smg = {router: s for router, s in summary.items() if router.split(":")[0] in SMG_KINDS}
    if ours not in summary or not smg:
        return []
    mine = summary[ours]
    best_tput = max(s["output_throughput"] for s in smg.values())
    best_p99 = min(s["ttft_p99"] for s in smg.values())
    cache_hits = [s["hit"] for r, s in smg.items() if r.endswith(":cache_aware") and s["hit"] is not None]
    checks = [
        f"out tok/s {fmt(mine['output_throughput'])} vs smg's best {fmt(best_tput)}: "
        + ("met" if mine["output_throughput"] > best_tput else "NOT met"),
        f"TTFT p99 {fmt(mine['ttft_p99'], 0)} ms vs smg's best {fmt(best_p99, 0)} ms: "
        + ("met" if mine["ttft_p99"] < best_p99 else "NOT met"),
    ]
    if cache_hits and mine["hit"] is not None:
        best_hit = max(cache_hits)
        checks.append(
            f"hit {fmt(100 * mine['hit'])}% vs smg cache_aware's {fmt(100 * best_hit)}%: "
            + ("met" if mine["hit"] >= best_hit - 0.02 else "NOT met")
        )
    spread = mine["equal_share_spread"]
    checks.append(
        f"equal workers' prompt tokens within {fmt(None if spread is None else 100 * spread)}%: "
        + ("met" if spread is not None and spread <= 0.15 else "NOT met")
    )
    return checks


def markdown(shape: str, workload: str, runs: list[dict[str, Any]], workers: list[Worker], ours: str) -> str:
    names = [w.name for w in workers]
    routers = list(dict.fromkeys(run["router"] for run in runs))
    lines = [
        f"**{shape} / {workload}** (workers {', '.join(f'{w.name} {w.speed}' for w in workers)}; "
        "median [min-max] over the repeats)",
        "",
        f"| router | out tok/s | TTFT p50 (ms) | TTFT p99 (ms) | fleet hit (%) | prompt tokens {' / '.join(names)} "
        "(median) | equal workers' spread (%) | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for router in routers:
        rs = [r for r in runs if r["router"] == router]
        tokens = " / ".join(
            fmt(statistics.median(r["worker_deltas"][n]["prompt_tokens"] for r in rs), 0) for n in names
        )
        lines.append(
            f"| {router} | {median_spread([r['output_throughput'] for r in rs], 1)} "
            f"| {median_spread([r['ttft_ms']['median'] for r in rs])} "
            f"| {median_spread([r['ttft_ms']['p99'] for r in rs])} "
            f"| {median_spread([r['fleet_cache_hit_rate'] for r in rs], 1, 100)} | {tokens} "
            f"| {median_spread([r['equal_share_spread'] for r in rs], 0, 100)} | {sum(r['failed'] for r in rs)} |"
        )
    checks = goals(summarize(runs), ours)
    if checks:
        lines += ["", f"Goals for {ours}: " + "; ".join(checks) + "."]
    return "\n".join(lines)


def overhead_markdown(overhead: dict[str, list[dict[str, Any]]]) -> str:
    """Medians [min-max] over the repeats; "added" is each repeat's figure less the direct one's median."""
    direct = overhead["direct"]
    direct_p50 = statistics.median(r["latency"]["latency_ms_p50"] for r in direct)
    direct_p99 = statistics.median(r["latency"]["latency_ms_p99"] for r in direct)
    lines = [
        "| target (one default worker) | latency p50 (ms) | p99 (ms) | added p50 (ms) | added p99 (ms) "
        "| ceiling (req/s) | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, results in overhead.items():
        p50 = [r["latency"]["latency_ms_p50"] for r in results]
        p99 = [r["latency"]["latency_ms_p99"] for r in results]
        added50 = [v - direct_p50 for v in p50] if label != "direct" else []
        added99 = [v - direct_p99 for v in p99] if label != "direct" else []
        errors = sum(r["latency"]["errors"] + r["ceiling"]["errors"] for r in results)
        lines.append(
            f"| {label} | {median_spread(p50, 2)} | {median_spread(p99, 2)} "
            f"| {median_spread(added50, 2) if added50 else '-'} "
            f"| {median_spread(added99, 2) if added99 else '-'} "
            f"| {median_spread([r['ceiling']['requests_per_s'] for r in results], 1)} | {errors} |"
        )
    return "\n".join(lines)


def machine(smg_bins: dict[str, str]) -> dict[str, Any]:
    facts: dict[str, Any] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "Flags"):
                facts[key.strip().lower().replace(" ", "_")] = value.strip()
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        git = ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]
        facts["commit"] = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    facts["smg"] = {kind: smg_version(binary) for kind, binary in smg_bins.items()}
    return facts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.HelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory ('' for the built-in demo model)")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="each worker's KV pool")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument(
        "--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS, help="none: the overhead part alone"
    )
    p.add_argument(
        "--routers", nargs="+", default=list(ROUTERS), help="KIND:POLICY, KIND smg-0.3.2, smg-1.13 or radixserve"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of each router on each shape and workload")
    p.add_argument(
        "--smg-0-3-2", default=shutil.which("smg"), help="smg 0.3.2's command (pip install sglang-router==0.3.2)"
    )
    p.add_argument("--smg-1-13", default=None, help="smg 1.13's command (its own venv: pip install smg==1.13.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gsp-num-groups",
        type=int,
        default=12,
        help="a multiple of the equal workers: whole groups can be shared equally",
    )
    p.add_argument("--gsp-prompts-per-group", type=int, default=4)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--long-prompts", type=int, default=16, help="requests of the long-prompts workload")
    p.add_argument("--long-prompt-len", type=int, default=1536, help="its longest prompt (tokens)")
    p.add_argument(
        "--long-range-ratio", type=float, default=0.33, help="its shortest prompt, as a share of the longest"
    )
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=16, help="0: no limit")
    p.add_argument("--request-rate", default="inf", help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--router-warmup", type=int, default=3, help="short requests through each router before its run")
    p.add_argument("--latency-requests", type=int, default=300, help="small requests at concurrency 1")
    p.add_argument("--ceiling-requests", type=int, default=2000, help="small requests for the requests/s ceiling")
    p.add_argument("--ceiling-concurrency", type=int, default=64)
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one router's bench run may take")
    p.add_argument("--out-dir", type=Path, default=None, help="logs, bench.jsonl and results.json (default: a tmp dir)")
    return p.parse_args(argv)


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def smg_commands(ns: argparse.Namespace) -> dict[str, str]:
    """Each smg kind whose command is given (the overhead part measures them all); exits
    naming a kind ``--routers`` needs and lacks."""
    commands = {"smg-0.3.2": ns.smg_0_3_2, "smg-1.13": ns.smg_1_13}
    for kind in {spec.split(":")[0] for spec in ns.routers} & set(SMG_KINDS):
        if not commands[kind]:
            flag = "--" + kind.replace(".", "-")
            sys.exit(f"{kind} is not installed: give its command with {flag} (see this script's docstring)")
    return {kind: command for kind, command in commands.items() if command}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    smg_bins = smg_commands(ns)
    ours = next((spec for spec in ns.routers if spec.startswith("radixserve:")), "")
    out = ns.out_dir or Path(tempfile.mkdtemp(prefix="compare-router-"))
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    procs = Processes(out)
    started = time.monotonic()
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items()},
        "machine": machine(smg_bins),
        "shapes": {},
    }
    print(f"logs and results in {out}", flush=True)
    tables: list[str] = []
    try:
        for shape in ns.shapes:
            workers = start_workers(ns, shape, procs)
            info = httpx.get(workers[0].url + "/get_server_info", timeout=30).json()
            tokenizer = info.get("tokenizer_path") or info["model_path"]
            runs: list[dict[str, Any]] = []
            report["shapes"][shape] = {"workers": [vars(w) for w in workers], "runs": runs}
            for workload in ns.workloads:
                for repeat in range(ns.repeats):
                    order = ns.routers[repeat % len(ns.routers) :] + ns.routers[: repeat % len(ns.routers)]
                    for spec in order:
                        run = fleet_run(ns, spec, workload, workers, tokenizer, procs, out, smg_bins)
                        run["repeat"] = repeat
                        runs.append(run)
                        print(
                            f"{shape} {workload} #{repeat} {spec}: {run['output_throughput']:.1f} out tok/s, TTFT p50 "
                            f"{run['ttft_ms']['median']:.0f} p99 {run['ttft_ms']['p99']:.0f} ms, hit "
                            f"{run['fleet_cache_hit_rate']:.3f}, router CPU {run['router_cpu_s']:.2f} s, prompt tokens "
                            + ", ".join(f"{n} {round(d['prompt_tokens'])}" for n, d in run["worker_deltas"].items()),
                            flush=True,
                        )
                tables.append(markdown(shape, workload, [r for r in runs if r["workload"] == workload], workers, ours))
                print(tables[-1], flush=True)
            if not ns.skip_overhead and "overhead" not in report:
                report["overhead"] = overhead_runs(ns, workers[0], procs, smg_bins)
                tables.append(overhead_markdown(report["overhead"]))
                print(tables[-1], flush=True)
            procs.stop_all()
    finally:
        procs.stop_all()
        report["runtime_s"] = time.monotonic() - started
        (out / "results.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "tables.md").write_text("\n\n".join(tables) + "\n")
    print("\n\n".join(tables))
    print(f"\nruntime {report['runtime_s']:.0f} s; raw numbers in {out / 'results.json'}")
    failed = sum(run["failed"] for shape in report["shapes"].values() for run in shape["runs"])
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
