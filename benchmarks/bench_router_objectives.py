"""Latency objectives through ``radixserve router``: does a request stating
``x-slo-tpot-ms`` find the speculative worker of a fleet, and what does it gain?

A fleet of two workers of one model (``OMP_NUM_THREADS`` 1 each, ``--backend-selection
priority``): ``spec`` with ``--speculative-algorithm ngram``, ``plain`` without; the router
in front (``latency_aware``, loads polled every 0.3 s). Each worker is warmed directly
with a few streamed requests alone, so that both have measured their batch-1 decode
band, and their time per output token alone is measured (the median over those
requests). The objective is then their geometric mean, unless ``--tpot-ms`` gives it.

Then, for each mode in turn (``--rounds`` times, alternating): two background clients
send requests through the router without objectives (64 output tokens, one after
another each), while a foreground client sends ``--requests`` streamed requests one
after another, each a prompt the n-gram proposer can follow: in mode ``none`` without
headers, in mode ``objective`` with ``x-slo-tpot-ms``. The prompts: with ``--prompts``
(the ``heldout.jsonl`` of ``train_speculative_models.py``), its ``repeat`` prompts in the
foreground (a function, then a request to write it again: the output copies its input)
and its ``continue`` prompts in the background; else random token runs repeated (the
foreground) and random tokens (the background).
Foreground and background are told apart in ``/debug/decisions`` by their
``max_tokens`` (63 and 64).

Printed per mode: the foreground requests placed on ``spec``, their time per output
token (the stream's last token less its first, over the tokens between) and TTFT,
p50/p90, and the background's output tokens per second. The model: ``--model``, else
the tiny Llama that ``build_tiny_model`` writes (hidden 256, 4 layers). Speculation
pays only on a model that has learned something (random weights rarely continue as
the n-gram proposer guesses), so the figures that matter come from the trained target::

    python benchmarks/train_speculative_models.py --threads 2 --draft-minutes 0.2 --eagle-minutes 0 --eagle3-minutes 0
    python benchmarks/bench_router_objectives.py --model ~/.cache/radixserve-bench/speculative/target \
        --prompts ~/.cache/radixserve-bench/speculative/heldout.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ADMIN = {"Authorization": "Bearer admin"}
FOREGROUND_TOKENS, BACKGROUND_TOKENS = 63, 64


class Process:
    """A ``radixserve`` command whose announced URL is read from its output."""

    def __init__(self, *argv: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.cli", *argv, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.url: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if " ready at " in line:
                self.url = line.split(" ready at ")[1].split()[0]
                self.ready.set()
        self.ready.set()

    def wait(self, timeout: float = 300) -> str:
        if not self.ready.wait(timeout) or self.url is None:
            raise RuntimeError(f"{self.proc.args} did not start")
        return self.url

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@contextlib.contextmanager
def fleet(model: str) -> Iterator[tuple[dict[str, str], str]]:
    common = ("serve", "--model", model, "--served-model-name", "bench", "--max-total-tokens", "16384")
    common += ("--backend-selection", "priority")
    env = {"OMP_NUM_THREADS": "1"}
    started = {
        "spec": Process(*common, "--speculative-algorithm", "ngram", env=env),
        "plain": Process(*common, env=env),
    }
    router: Process | None = None
    try:
        urls = {name: p.wait() for name, p in started.items()}
        router = Process(
            "router", "--worker-urls", *urls.values(), "--admin-api-key", "admin", "--load-poll-interval-secs", "0.3"
        )
        router_url = router.wait()
        deadline = time.monotonic() + 60
        while len(httpx.get(router_url + "/workers", headers=ADMIN, timeout=10).json()["workers"]) < len(urls):
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not list both workers within 60 s")
            time.sleep(0.2)
        yield urls, router_url
    finally:
        for process in [*started.values(), *([router] if router else [])]:
            process.stop()


class Prompts:
    """The foreground's and the background's prompts (text, or token ids)."""

    def __init__(self, path: Path | None, vocab: int):
        self.vocab = vocab
        self.kinds: dict[str, list[str]] = {"repeat": [], "continue": []}
        if path is not None:
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                self.kinds.setdefault(entry["kind"], []).append(entry["prompt"])

    def foreground(self, rng: random.Random) -> str | list[int]:
        if self.kinds["repeat"]:
            return rng.choice(self.kinds["repeat"])
        run = [rng.randrange(5, self.vocab) for _ in range(12)]
        return run * 8

    def background(self, rng: random.Random) -> str | list[int]:
        if self.kinds["continue"]:
            return rng.choice(self.kinds["continue"])
        return [rng.randrange(5, self.vocab) for _ in range(128)]


def stream(
    url: str, prompt: str | list[int], max_tokens: int, headers: dict[str, str] | None = None
) -> tuple[float, float]:
    """(TTFT, time per output token) of one streamed greedy completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body["stream"] = True
    started, times = time.perf_counter(), []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    # A streamed chunk may carry several tokens (a verify step's): the span over the tokens after the first.
    return times[0] - started, (times[-1] - times[0]) / (max_tokens - 1)


def background(url: str, prompts: Prompts, stop: threading.Event, tokens: list[int], seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        body = {"model": "bench", "prompt": prompts.background(rng), "max_tokens": BACKGROUND_TOKENS, "temperature": 0}
        body["ignore_eos"] = True
        answer = httpx.post(url + "/v1/completions", json=body, timeout=600)
        answer.raise_for_status()
        tokens.append(answer.json()["usage"]["completion_tokens"])


def run_mode(
    router: str, urls: dict[str, str], prompts: Prompts, requests: int, headers: dict[str, str], seed: int
) -> dict:
    stop, tokens = threading.Event(), []
    clients = [threading.Thread(target=background, args=(router, prompts, stop, tokens, seed + k)) for k in range(2)]
    started = time.perf_counter()
    for client in clients:
        client.start()
    rng, measured = random.Random(seed), []
    try:
        for _ in range(requests):
            measured.append(stream(router, prompts.foreground(rng), FOREGROUND_TOKENS, headers))
    finally:
        stop.set()
        for client in clients:
            client.join()
    seconds = time.perf_counter() - started
    decisions = httpx.get(router + "/debug/decisions", params={"limit": 256}, headers=ADMIN, timeout=30).json()
    names = {url: name for name, url in urls.items()}
    placed = [names[d["chosen"]] for d in decisions["decisions"] if d["max_tokens"] == FOREGROUND_TOKENS]
    return {
        "on_spec": placed[-requests:].count("spec"),
        "ttft_ms": [m[0] * 1000 for m in measured],
        "tpot_ms": [m[1] * 1000 for m in measured],
        "background_tok_s": sum(tokens) / seconds,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: a tiny random Llama, built here)")
    parser.add_argument("--prompts", type=Path, help="train_speculative_models.py's heldout.jsonl")
    parser.add_argument("--requests", type=int, default=12, help="foreground requests per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tpot-ms", type=float, help="the objective (default: the workers' geometric mean)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from radixserve.checkpoints.random_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden_size=256, num_layers=4))
    prompts = Prompts(args.prompts, json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    with fleet(model) as (urls, router):
        rng = random.Random(args.seed + 99)
        alone = {
            name: statistics.median(stream(url, prompts.foreground(rng), FOREGROUND_TOKENS)[1] for _ in range(4))
            for name, url in urls.items()
        }
        objective_ms = args.tpot_ms or 1000 * math.sqrt(alone["spec"] * alone["plain"])
        print(
            f"alone, ms per output token: spec {alone['spec'] * 1000:.2f}, plain {alone['plain'] * 1000:.2f}; "
            f"objective x-slo-tpot-ms {objective_ms:.2f}",
            flush=True,
        )
        modes = {"none": {}, "objective": {"x-slo-tpot-ms": f"{objective_ms:.3f}"}}
        results: dict[str, list[dict]] = {mode: [] for mode in modes}
        for round_ in range(args.rounds):
            order = list(modes) if round_ % 2 == 0 else list(reversed(modes))
            for mode in order:
                got = run_mode(router, urls, prompts, args.requests, modes[mode], args.seed + round_)
                results[mode].append(got)
                print(f"round {round_ + 1} {mode}: {json.dumps(got)}", flush=True)
    print("\n| mode | foreground on spec | TPOT p50 / p90 (ms) | TTFT p50 / p90 (ms) | background out tok/s |")
    print("|---|---|---|---|---|")
    for mode, runs in results.items():
        tpot = [v for r in runs for v in r["tpot_ms"]]
        ttft = [v for r in runs for v in r["ttft_ms"]]
        on_spec = sum(r["on_spec"] for r in runs)
        print(
            f"| {mode} | {on_spec} of {len(tpot)} | {percentile(tpot, 0.5):.2f} / {percentile(tpot, 0.9):.2f} | "
            f"{percentile(ttft, 0.5):.0f} / {percentile(ttft, 0.9):.0f} | "
            f"{statistics.mean(r['background_tok_s'] for r in runs):.1f} |"
        )


if __name__ == "__main__":
    main()
