"""Server start time: from the command to ``radixserve ready at URL``.

    python benchmarks/bench_server_start.py                    # the demo model, 5 starts
    python benchmarks/bench_server_start.py --runs 9 -- --log-level debug --model DIR

Each run starts ``python -m radixserve.cli serve --port 0`` (the OS picks a free
port; flags after ``--`` are added), times the ``listening`` and ``ready`` lines
on its stdout, checks that ``GET /health`` answers 200, then stops it with
SIGTERM and waits for it to exit. Prints each run (with the CPU seconds of the
server and its children, start to exit: a figure that other load on the machine
moves less than the wall time), then the median and the minimum. A server that
fails to start ends the benchmark with its stderr's tail.

The first start of a machine builds the demo model and compiles the CPU kernels
(tens of seconds): run once before timing, or pass ``--warmup 1``.
"""

from __future__ import annotations

import argparse
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

READY = "radixserve ready at "
LISTENING = "radixserve listening at "


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def start_once(extra: list[str], timeout: float) -> tuple[float, float, float]:
    """Seconds to the listening line and to the ready line of one server start,
    and the CPU seconds of the server's processes from start to exit."""
    command = [sys.executable, "-m", "radixserve.cli", "serve", "--port", "0", *extra]
    cpu_before = children_cpu_s()
    with tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
        listening = ready = None
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(LISTENING):
                    listening = time.perf_counter() - start
                if line.startswith(READY):
                    ready = time.perf_counter() - start
                    url = line[len(READY) :].strip()
                    break
                if time.perf_counter() - start > timeout:
                    break
            if ready is None or listening is None:
                stderr.seek(0)
                tail = "".join(stderr.readlines()[-20:])
                raise SystemExit(f"the server did not get ready (exit code {proc.poll()}):\n{tail}")
            httpx.get(f"{url}/health", timeout=10).raise_for_status()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    return listening, ready, children_cpu_s() - cpu_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=0, help="untimed starts first")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take")
    parser.add_argument("serve_args", nargs="*", help="flags for `radixserve serve`, after --")
    args = parser.parse_args()

    for _ in range(args.warmup):
        start_once(args.serve_args, args.timeout)
    readies = []
    for run in range(args.runs):
        listening, ready, cpu = start_once(args.serve_args, args.timeout)
        readies.append(ready)
        print(f"run {run + 1}: listening {listening:5.2f} s, ready {ready:5.2f} s, CPU {cpu:5.2f} s", flush=True)
    print(f"ready: median {statistics.median(readies):.2f} s, min {min(readies):.2f} s over {args.runs} runs")


if __name__ == "__main__":
    main()
