"""radixserve router against SGLang's model gateway (``smg``, sglang-router 0.3.2) on a mixed fleet.

One run, the same three workers and the same requests for every router (issue 24):

1. Three workers of one model, each ``--served-model-name bench``, ``OMP_NUM_THREADS=1`` and
   a fixed ``--max-total-tokens``, on different backends: ``cpu`` (the defaults), ``plugin``
   (the example kernel plugin, installed with ``pip --target`` into a scratch directory and
   put on ``PYTHONPATH``) and ``triton`` (Triton kernels under ``TRITON_INTERPRET=1``: the
   stand-in for a slower device).
2. For each router (smg cache_aware, smg round_robin, radixserve cache_aware, capacity_aware
   and latency_aware): flush every worker's cache, warm every worker with one direct request,
   start the router (a fresh process), wait until it lists the three workers, send a few
   warm-up requests through it, then the shared-prefix set (``radixserve bench serving
   --dataset generated-shared-prefix``, fixed seed). Recorded: output tok/s, TTFT p50/p99,
   the fleet's cache hit rate (the workers' cached over prompt tokens, deltas over the run)
   and the requests each worker served (deltas of its ``num_requests_total``).
3. Router overhead, each router in front of the CPU worker alone: latency of small
   requests (one output token) at concurrency 1, and the requests/s ceiling at high
   concurrency, against the same requests sent to the worker directly.

Prints a markdown table and writes every number as JSON (``--out-dir``). Every process
started here (workers, routers, the client) is stopped on exit, error or Ctrl-C.

    python benchmarks/compare_router.py --out-dir /tmp/compare-router
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
ROUTERS = (
    "smg:cache_aware",
    "smg:round_robin",
    "radixserve:cache_aware",
    "radixserve:capacity_aware",
    "radixserve:latency_aware",
)
# The gateway each router kind is measured with for the overhead part (one worker; each default policy).
OVERHEAD_ROUTERS = ("smg:cache_aware", "radixserve:latency_aware")


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


def worker_specs(ns: argparse.Namespace, plugin_dir: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (extra serve flags, extra environment)."""
    triton_flags = [flag for kind in ns.triton_kinds for flag in (f"--{kind}-backend", "triton")]
    return {
        "cpu": ([], {}),
        "plugin": (
            ["--attention-backend", "example_sdpa", "--gemm-backend", "example_gemm"],
            {"PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_dir), os.environ.get("PYTHONPATH")]))},
        ),
        "triton": (triton_flags, {"TRITON_INTERPRET": "1"}),
    }


def install_plugin(target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target)]
        + [str(REPO / "examples/kernel-plugin")],
        check=True,
    )


def start_workers(ns: argparse.Namespace, procs: Processes, plugin_dir: Path) -> list[Worker]:
    model = ["--model", ns.model] if ns.model else []
    started = []
    for name, (flags, env) in worker_specs(ns, plugin_dir).items():
        cmd = ["radixserve", "serve", *model, "--served-model-name", SERVED_NAME, "--port", "0"]
        cmd += ["--max-total-tokens", str(ns.max_total_tokens), *flags]
        started.append((name, procs.start(f"worker-{name}", cmd, {"OMP_NUM_THREADS": "1", **env})))
    workers = []
    for name, proc in started:
        url = procs.wait_for_line(proc, READY_WORKER, ns.startup_timeout)
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        workers.append(Worker(name, url, info.get("backends") or {}))
        print(f"worker {name} ready at {url}: backends {info.get('backends')}, dtype {info.get('dtype')}", flush=True)
    return workers


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
    """Empty every prefix cache, then one direct request each, so that each worker has a
    measured decode rate (capacity_aware and latency_aware read them) and identical state for every router."""
    for worker in workers:
        response = httpx.post(worker.url + "/flush_cache", timeout=60)
        response.raise_for_status()
    for worker in workers:
        body = {"model": SERVED_NAME, "prompt": f"{prompt} ({worker.name})", "max_tokens": 16, "ignore_eos": True}
        httpx.post(worker.url + "/v1/completions", json=body, timeout=600).raise_for_status()


# ---- routers -----------------------------------------------------------------------------
def start_router(spec: str, urls: list[str], procs: Processes, timeout: float) -> tuple[Proc, str]:
    """``spec``: ``smg:POLICY`` or ``radixserve:POLICY``; returns once it lists every worker
    as healthy (ours: and has read each one's load)."""
    kind, policy = spec.split(":")
    name = f"router-{kind}-{policy}-{len(urls)}w"
    if kind == "smg":
        port = free_port()
        cmd = [shutil.which("smg") or "smg", "launch", "--worker-urls", *urls, "--policy", policy]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
        proc = procs.start(name, cmd)
        url = f"http://127.0.0.1:{port}"
    else:
        cmd = ["radixserve", "router", "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1"]
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
    if kind == "smg":
        return all(w.get("is_healthy") for w in workers)
    return all(w["healthy"] and w["load"]["decode_tokens_per_s"] for w in workers)


def router_workers(url: str) -> Any:
    try:
        return httpx.get(url + "/workers", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None


# ---- clients -----------------------------------------------------------------------------
def run_bench_serving(ns: argparse.Namespace, url: str, tokenizer: str, label: str, out_file: Path, procs: Processes):
    """One ``radixserve bench serving`` run of the shared-prefix set; its JSON line."""
    cmd = ["radixserve", "bench", "serving", "--base-url", url, "--model", SERVED_NAME, "--tokenizer", tokenizer]
    cmd += ["--dataset", "generated-shared-prefix", "--prompt-format", "text", "--seed", str(ns.seed)]
    cmd += ["--gsp-num-groups", str(ns.gsp_num_groups), "--gsp-prompts-per-group", str(ns.gsp_prompts_per_group)]
    cmd += ["--gsp-system-prompt-len", str(ns.gsp_system_prompt_len), "--gsp-question-len", str(ns.gsp_question_len)]
    cmd += ["--gsp-output-len", str(ns.gsp_output_len), "--request-rate", str(ns.request_rate)]
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
    return json.loads(lines[-1])


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


# ---- the run -----------------------------------------------------------------------------
def fleet_run(ns: argparse.Namespace, spec: str, workers: list[Worker], tokenizer: str, procs: Processes, out: Path):
    flush_and_warm(workers, "The quick brown fox jumps over the lazy dog")
    router, url = start_router(spec, [w.url for w in workers], procs, ns.startup_timeout)
    try:
        warm_router(url, ns.router_warmup)
        before = {w.name: worker_counters(w.url) for w in workers}
        started = time.monotonic()
        result = run_bench_serving(ns, url, tokenizer, spec.replace(":", "-"), out / "bench.jsonl", procs)
        wall = time.monotonic() - started
        after = {w.name: worker_counters(w.url) for w in workers}
        listing = router_workers(url)
    finally:
        procs.stop(router)
    delta = {name: {k: after[name][k] - before[name][k] for k in after[name]} for name in after}
    prompt = sum(d["prompt_tokens"] for d in delta.values())
    cached = sum(d["cached_tokens"] for d in delta.values())
    return {
        "router": spec,
        "completed": result["completed"],
        "failed": result["failed"],
        "errors": result["errors"],
        "duration_s": result["duration_s"],
        "wall_s": wall,
        "output_throughput": result["output_throughput"],
        "request_throughput": result["request_throughput"],
        "ttft_ms": result["ttft_ms"],
        "e2e_latency_ms": result["e2e_latency_ms"],
        "client_cache_hit_rate": result["cache_hit_rate"],
        "fleet_cache_hit_rate": cached / prompt if prompt else None,
        "worker_deltas": delta,
        "router_workers": listing,
    }


def overhead_runs(ns: argparse.Namespace, cpu: Worker, procs: Processes) -> dict[str, Any]:
    prompt = "Say hello."
    targets: list[tuple[str, str | None]] = [("direct", None), *((spec, spec) for spec in OVERHEAD_ROUTERS)]
    results = {}
    for label, spec in targets:
        router = None
        url = cpu.url
        if spec:
            router, url = start_router(spec, [cpu.url], procs, ns.startup_timeout)
        try:
            latency = small_requests(url, ns.latency_requests, 1, prompt)
            ceiling = small_requests(url, ns.ceiling_requests, ns.ceiling_concurrency, prompt)
        finally:
            if router:
                procs.stop(router)
        results[label] = {"latency": latency, "ceiling": ceiling}
        print(
            f"overhead {label}: p50 {latency['latency_ms_p50']:.2f} ms, p99 {latency['latency_ms_p99']:.2f} ms; "
            f"ceiling {ceiling['requests_per_s']:.1f} req/s ({ceiling['errors']} errors)",
            flush=True,
        )
    return results


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(fleet: list[dict[str, Any]], overhead: dict[str, Any], names: list[str]) -> str:
    served_by = " / ".join(names)
    lines = [
        f"| router | out tok/s | TTFT p50 (ms) | TTFT p99 (ms) | fleet cache hit | requests {served_by} | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in fleet:
        served = " / ".join(str(round(run["worker_deltas"][n]["requests"])) for n in names)
        lines.append(
            f"| {run['router']} | {fmt(run['output_throughput'])} | {fmt(run['ttft_ms']['median'])} "
            f"| {fmt(run['ttft_ms']['p99'])} | {fmt(100 * (run['fleet_cache_hit_rate'] or 0))}% "
            f"| {served} | {run['failed']} |"
        )
    if overhead:
        direct = overhead["direct"]
        lines += [
            "",
            "| target (CPU worker alone) | latency p50 (ms) | p99 (ms) | added p50 (ms) | ceiling (req/s) | errors |",
            "|---|---|---|---|---|---|",
        ]
        for label, result in overhead.items():
            lat, ceil = result["latency"], result["ceiling"]
            added = lat["latency_ms_p50"] - direct["latency"]["latency_ms_p50"] if label != "direct" else 0.0
            lines.append(
                f"| {label} | {fmt(lat['latency_ms_p50'], 2)} | {fmt(lat['latency_ms_p99'], 2)} | {fmt(added, 2)} "
                f"| {fmt(ceil['requests_per_s'])} | {lat['errors'] + ceil['errors']} |"
            )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    facts: dict[str, Any] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "Flags"):
                facts[key.strip().lower().replace(" ", "_")] = value.strip()
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        git = ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True)
        facts["commit"] = commit.stdout.strip()
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        smg = subprocess.run([sys.executable, "-m", "pip", "show", "sglang-router"], capture_output=True, text=True)
        facts["smg"] = next((ln.split()[-1] for ln in smg.stdout.splitlines() if ln.startswith("Version:")), None)
    return facts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.HelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory ('' for the built-in demo model)")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="each worker's KV pool")
    p.add_argument(
        "--triton-kinds",
        nargs="+",
        default=["elementwise"],
        choices=["attention", "elementwise"],
        help="backend kinds the triton worker runs as interpreted Triton kernels",
    )
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), help="KIND:POLICY, KIND smg or radixserve")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=12)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=32)
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


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if not shutil.which("smg") and any(spec.startswith("smg:") for spec in ns.routers):
        sys.exit("smg not found: pip install sglang-router==0.3.2")
    out = ns.out_dir or Path(tempfile.mkdtemp(prefix="compare-router-"))
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    procs = Processes(out)
    started = time.monotonic()
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items()},
        "machine": machine(),
    }
    print(f"logs and results in {out}", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="kernel-plugin-") as plugin_dir:
            install_plugin(Path(plugin_dir))
            workers = start_workers(ns, procs, Path(plugin_dir))
            report["workers"] = {w.name: {"url": w.url, "backends": w.backends} for w in workers}
            info = httpx.get(workers[0].url + "/get_server_info", timeout=30).json()
            tokenizer = info.get("tokenizer_path") or info["model_path"]
            fleet: list[dict[str, Any]] = []
            report["fleet"] = fleet
            for spec in ns.routers:
                print(f"--- {spec}", flush=True)
                run = fleet_run(ns, spec, workers, tokenizer, procs, out)
                fleet.append(run)
                print(
                    f"{spec}: {run['output_throughput']:.1f} out tok/s, TTFT p50 {run['ttft_ms']['median']:.0f} ms "
                    f"p99 {run['ttft_ms']['p99']:.0f} ms, hit {run['fleet_cache_hit_rate']:.3f}, requests "
                    + ", ".join(f"{n} {round(d['requests'])}" for n, d in run["worker_deltas"].items()),
                    flush=True,
                )
            report["overhead"] = {} if ns.skip_overhead else overhead_runs(ns, workers[0], procs)
    finally:
        procs.stop_all()
        report["runtime_s"] = time.monotonic() - started
        (out / "results.json").write_text(json.dumps(report, indent=2, default=str))
    table = markdown(report["fleet"], report["overhead"], [w.name for w in workers])
    (out / "table.md").write_text(table + "\n")
    print(table)
    print(f"\nruntime {report['runtime_s']:.0f} s; raw numbers in {out / 'results.json'}")
    return 0 if all(run["failed"] == 0 for run in report["fleet"]) else 1


if __name__ == "__main__":
    sys.exit(main())
