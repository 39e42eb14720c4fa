"""A prefill/decode pair against two ordinary workers, behind our router, on the same
requests: long prompts arriving while many short requests decode.

    python benchmarks/bench_disaggregation.py [--repeats 2] [--out-dir DIR]

Two configurations, each of two workers of the llama benchmark model (as
compare_router.py; ``OMP_NUM_THREADS=1`` each):

- ``ordinary``: two default workers, ``radixserve router --worker-urls A B``;
- ``pd``: a prefill and a decode worker, ``radixserve router --pd-disaggregation``.

The workload: ``--streams`` short streamed requests (``--stream-tokens`` output each)
start together; while they decode, ``--long-prompts`` requests of about
``--long-words`` words arrive ``--long-interval`` seconds apart (streamed, a few output
tokens). Reported per configuration: the inter-token latency (ITL) of the short
streams, p50 and p99 over every gap between two of their tokens; TTFT p50/p99 of the
long prompts and of the short streams; output tokens per second over the run (whose
length the long prompts' schedule sets) and the short streams' own: their tokens
over the time until the last of them ended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from compare_router import DEFAULT_MODEL, READY_ROUTER, READY_WORKER, SERVED_NAME, Processes

WORDS = [f"w{i}" for i in range(400)] + ["the", "a", "of", "and", "to", "in", "is", "it", "that", "on"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion: when it was sent, and when each token came."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    sent = time.perf_counter()
    arrivals: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    arrivals.append(time.perf_counter())
    return {"sent": sent, "arrivals": arrivals}


async def workload(url: str, ns: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    short = [" ".join(rng.choices(WORDS, k=48)) for _ in range(ns.streams)]
    long = [" ".join(rng.choices(WORDS, k=ns.long_words)) for _ in range(ns.long_prompts)]
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.perf_counter()

        async def long_one(i: int, prompt: str) -> dict[str, Any]:
            await asyncio.sleep(ns.long_start + i * ns.long_interval)
            return await stream_one(session, url, prompt, ns.long_tokens)

        streams = [stream_one(session, url, p, ns.stream_tokens) for p in short]
        longs = [long_one(i, p) for i, p in enumerate(long)]
        results = await asyncio.gather(*streams, *longs)
        wall = time.perf_counter() - started
    short_results, long_results = results[: ns.streams], results[ns.streams :]
    gaps = [b - a for r in short_results for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    tokens = sum(len(r["arrivals"]) for r in results)
    ms = 1000.0
    return {
        "itl_ms_p50": percentile(gaps, 0.5) * ms,
        "itl_ms_p99": percentile(gaps, 0.99) * ms,
        "itl_ms_max": max(gaps) * ms if gaps else float("nan"),
        "ttft_long_ms_p50": percentile([r["arrivals"][0] - r["sent"] for r in long_results], 0.5) * ms,
        "ttft_long_ms_p99": percentile([r["arrivals"][0] - r["sent"] for r in long_results], 0.99) * ms,
        "ttft_short_ms_p50": percentile([r["arrivals"][0] - r["sent"] for r in short_results], 0.5) * ms,
        "ttft_short_ms_p99": percentile([r["arrivals"][0] - r["sent"] for r in short_results], 0.99) * ms,
        "output_tok_s": tokens / wall,
        # the short streams alone: their tokens over the time until the last of them ended
        "stream_tok_s": sum(len(r["arrivals"]) for r in short_results)
        / (max(r["arrivals"][-1] for r in short_results) - started),
        "wall_s": wall,
    }


def start_config(name: str, ns: argparse.Namespace, procs: Processes) -> str:
    """The two workers and the router of configuration ``name``; the router's URL."""
    model = ["--model", ns.model, "--served-model-name", SERVED_NAME, "--max-total-tokens", str(ns.max_total_tokens)]
    env = {"OMP_NUM_THREADS": "1"}
    if name == "ordinary":
        flags: list[list[str]] = [[], []]
    else:
        flags = [["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(ns.bootstrap_port)]]
        flags.append(["--disaggregation-mode", "decode"])
    workers = [
        procs.start(f"{name}-worker-{i}", ["radixserve", "serve", *model, "--port", "0", *f], env)
        for i, f in enumerate(flags)
    ]
    urls = [procs.wait_for_line(w, READY_WORKER, ns.startup_timeout) for w in workers]
    if name == "ordinary":
        routing = ["--worker-urls", *urls]
    else:
        routing = ["--pd-disaggregation", "--prefill", urls[0], str(ns.bootstrap_port), "--decode", urls[1]]
    router = procs.start(f"{name}-router", ["radixserve", "router", *routing, "--port", "0"])
    return procs.wait_for_line(router, READY_ROUTER, ns.startup_timeout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--long-words", type=int, default=400)
    p.add_argument("--long-tokens", type=int, default=4)
    p.add_argument("--long-start", type=float, default=1.0, help="seconds after the streams start")
    p.add_argument("--long-interval", type=float, default=1.5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--bootstrap-port", type=int, default=18998)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out-dir", type=Path, default=None)
    ns = p.parse_args()
    out = ns.out_dir or Path(tempfile.mkdtemp(prefix="bench-pd-"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {"ordinary": [], "pd": []}
    for repeat in range(ns.repeats):
        for name in ["ordinary", "pd"] if repeat % 2 == 0 else ["pd", "ordinary"]:
            procs = Processes(out)
            try:
                url = start_config(name, ns, procs)
                asyncio.run(workload(url, ns, seed=99))  # warm: code paths and caches' first fills
                result = asyncio.run(workload(url, ns, seed=repeat))
            finally:
                procs.stop_all()
            results[name].append(result)
            print(f"{name} #{repeat}: " + ", ".join(f"{k} {v:.1f}" for k, v in result.items()), flush=True)
    head = "| configuration | ITL p50 (ms) | ITL p99 (ms) | TTFT long p50 / p99 (ms) | TTFT short p50 / p99 (ms) |"
    print("\n" + head + " out tok/s | short streams' tok/s |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():

        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        print(
            f"| {name} | {med('itl_ms_p50'):.1f} | {med('itl_ms_p99'):.1f} | {med('ttft_long_ms_p50'):.0f} / "
            f"{med('ttft_long_ms_p99'):.0f} | {med('ttft_short_ms_p50'):.0f} / {med('ttft_short_ms_p99'):.0f} | "
            f"{med('output_tok_s'):.1f} | {med('stream_tok_s'):.1f} |"
        )
    (out / "results.json").write_text(
        json.dumps({"config": vars(ns) | {"out_dir": str(out)}, "results": results}, indent=2, default=str)
    )
    print(f"raw numbers in {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
