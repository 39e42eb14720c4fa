"""Speculative decoding: batch-1 latency and batched throughput with and without
each method, on models that have learned something (acceptance means nothing on
random weights), radixserve and vLLM's CPU engine on the same token-id requests.

    python benchmarks/train_speculative_models.py                       # once: target, draft, EAGLE heads, prompts
    python benchmarks/bench_speculative.py --out /tmp/spec.jsonl         # radixserve: none, ngram, draft, eagle, eagle3
    VLLM_CPU_OMP_THREADS_BIND=0-1 ~/.cache/radixserve-bench/vllm-venv/bin/python \\
        benchmarks/bench_speculative.py --engine vllm --out /tmp/spec.jsonl
    python benchmarks/bench_speculative.py --table /tmp/spec.jsonl
    python benchmarks/bench_speculative.py --step-cost --out /tmp/spec.jsonl   # verify vs decode step, per batch

Workloads (greedy, ``ignore_eos``, float32, prompts from the held-out files of the
training corpus, tokenized once by the radixserve side into ``requests.json`` next
to ``--out``, which the vLLM side replays):

- ``repeat`` at batch 1: a held-out function, then a comment asking for it again and
  the start of its ``def`` line; the output repeats its input (n-gram's case);
- ``continue`` at batch 1: the first few hundred tokens of a held-out file, to go on;
- ``continue`` at batch 16 and 64: the same kind, all requests at once.

Batch 1 runs the requests one after another and reports milliseconds per output
token (a request's whole latency over its tokens, prefill included, alike for both
engines); the batches report output tokens per second. Every workload runs once
unmeasured (an engine may compile per shape), then ``--rounds`` times: the median. With ``--alternate``,
the batch-1 workloads only, every method's engine started at once and the methods
taking turns round by round, so that a machine whose speed drifts (a shared 2-core
VM's moved 2x within a minute) slows them alike. radixserve's rows also give
the share of proposals kept and the tokens a verify step made per request (batch 1),
from ``/server_info``'s counters, and how many requests' tokens differ from the
unspeculated run's (greedy: none should). Each run appends one JSON line to ``--out``.

Only the standard library is imported at the top: the vLLM side runs in vLLM's own
virtualenv, which has no radixserve.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

DEFAULT_MODELS = Path.home() / ".cache/radixserve-bench/speculative"
METHODS = ("none", "ngram", "draft", "eagle", "eagle3")


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # the heldout.jsonl prompts it takes
    batch: int  # 1: one request at a time
    requests: int
    max_tokens: int


WORKLOADS = (
    Workload("repeat-b1", "repeat", 1, 6, 128),
    Workload("continue-b1", "continue", 1, 6, 128),
    Workload("continue-b16", "continue", 16, 16, 64),
    Workload("continue-b64", "continue", 64, 64, 64),
)


def selected(ns: argparse.Namespace) -> list[Workload]:
    """The workloads ``--workloads`` names, in the order of ``WORKLOADS``."""
    return [w for w in WORKLOADS if w.name in ns.workloads]


def machine() -> str:
    """``lscpu``'s model name, the CPU count and the ISA flags that matter here."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), platform.processor())
    flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile") if f" {f}" in flags]
    return f"{model} ({os.cpu_count()} cpus; {' '.join(isa)})"


def make_requests(models: Path, out: Path) -> dict[str, list[list[int]]]:
    """Token-id prompts per kind, tokenized once with the target's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models / "target")
    prompts: dict[str, list[list[int]]] = {"repeat": [], "continue": []}
    for line in (models / "heldout.jsonl").read_text().splitlines():
        item = json.loads(line)
        prompts[item["kind"]].append(tokenizer(item["prompt"])["input_ids"])
    out.write_text(json.dumps(prompts))
    return prompts


def run_workloads(
    engine: str,
    method: str,
    prompts: dict[str, list[list[int]]],
    generate: Callable[[list[list[int]], int], list[list[int]]],
    counters: Callable[[], dict[str, int]],
    reference: dict[str, list[list[int]]],
    out: Path,
    rounds: int,
    workloads: list[Workload],
) -> dict[str, list[list[int]]]:
    """Each workload ``rounds`` times after a warm-up of every shape; the median figure
    (milliseconds per token at batch 1, output tokens per second in a batch), every
    round's, and the last round's counters. Returns the tokens each request got."""
    got: dict[str, list[list[int]]] = {}
    for w in workloads:  # warm-up: every shape once (an engine may compile per shape)
        generate(prompts[w.kind][: w.batch], 8)
    for w in workloads:
        requests = prompts[w.kind][: w.requests]
        figures = []
        for _ in range(rounds):
            before = counters()
            start = time.perf_counter()
            if w.batch == 1:
                tokens, latencies = [], []
                for prompt in requests:
                    begun = time.perf_counter()
                    tokens += generate([prompt], w.max_tokens)
                    latencies.append((time.perf_counter() - begun) / w.max_tokens)
                figure = 1000 * sum(latencies) / len(latencies)
            else:
                tokens = generate(requests, w.max_tokens)
                figure = sum(len(t) for t in tokens) / (time.perf_counter() - start)
            seconds = time.perf_counter() - start
            after = counters()
            figures.append(figure)
        got[w.name] = tokens
        output_tokens = sum(len(t) for t in tokens)
        delta = {k: after[k] - before.get(k, 0) for k in after}  # the last round's
        median = statistics.median(figures)
        line: dict[str, Any] = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(),
            "engine": engine,
            "method": method,
            "workload": w.name,
            "batch": w.batch,
            "requests": len(requests),
            "output_tokens": output_tokens,
            "seconds": round(seconds, 3),
            "rounds": [round(f, 2) for f in figures],
            "output_tok_per_s": round(median, 1) if w.batch > 1 else round(output_tokens / seconds, 1),
            "ms_per_token": round(median, 3) if w.batch == 1 else None,
            "differ_from_none": sum(a != b for a, b in zip(tokens, reference.get(w.name, tokens), strict=True)),
        }
        if delta.get("proposed"):
            line["kept_share"] = round(delta["accepted"] / delta["proposed"], 3)
            if w.batch == 1:
                line["tokens_per_verify"] = round(1 + delta["accepted"] / max(delta["verify_steps"], 1), 2)
        print(json.dumps(line), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")
    return got


def radixserve_side(ns: argparse.Namespace) -> None:
    from radixserve import Engine

    prompts = make_requests(ns.models, ns.out.with_name("requests.json"))
    target, draft = ns.models / "target", ns.models / "draft"
    settings = {
        "none": {},
        "ngram": {"speculative_algorithm": "ngram"},
        "draft": {"speculative_algorithm": "draft", "speculative_draft_model_path": str(draft)},
        "eagle": {"speculative_algorithm": "eagle", "speculative_eagle_path": str(ns.models / "eagle")},
        "eagle3": {"speculative_algorithm": "eagle", "speculative_eagle_path": str(ns.models / "eagle3")},
    }

    def open_engine(method: str) -> Engine:
        spec = {**settings[method], "speculative_num_draft_tokens": ns.num_draft_tokens} if method != "none" else {}
        return Engine(model_path=str(target), dtype="float32", log_level="warning", **spec)

    if ns.alternate:
        with contextlib.ExitStack() as stack:
            engines = {method: stack.enter_context(open_engine(method)) for method in ns.methods}
            alternate_batch_one(engines, prompts, ns.out, ns.rounds, selected(ns))
        return
    reference: dict[str, list[list[int]]] = {}
    for method in ns.methods:
        with open_engine(method) as engine:
            generate, counters = engine_generate(engine), engine_counters(engine)
            got = run_workloads(
                "radixserve", method, prompts, generate, counters, reference, ns.out, ns.rounds, selected(ns)
            )
            if method == "none":
                reference = got


def engine_generate(engine: Any) -> Callable[[list[list[int]], int], list[list[int]]]:
    def generate(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        results = engine.generate(input_ids=batch, sampling_params=params)
        return [r["output_ids"] for r in results]

    return generate


def engine_counters(engine: Any) -> Callable[[], dict[str, int]]:
    def counters() -> dict[str, int]:
        stats = engine.server_info()["stats"]
        return {
            "proposed": stats["spec_proposed_tokens_total"],
            "accepted": stats["spec_accepted_tokens_total"],
            "verify_steps": stats["spec_verify_steps"],
        }

    return counters


def alternate_batch_one(
    engines: dict[str, Any], prompts: dict[str, list[list[int]]], out: Path, rounds: int, chosen: list[Workload]
) -> None:
    """The batch-1 workloads with every method's engine running at once, the methods
    taking turns round by round, so that a machine whose speed drifts (a shared VM)
    slows them alike; one line per method and workload, as ``run_workloads`` writes."""
    workloads = [w for w in chosen if w.batch == 1]
    for engine in engines.values():  # warm-up
        engine_generate(engine)(prompts["continue"][:1], 8)
    figures: dict[tuple[str, str], list[float]] = {(m, w.name): [] for m in engines for w in workloads}
    tokens: dict[tuple[str, str], list[list[int]]] = {}
    before = {m: engine_counters(e)() for m, e in engines.items()}
    for _ in range(rounds):
        for method, engine in engines.items():
            generate = engine_generate(engine)
            for w in workloads:
                got, latencies = [], []
                for prompt in prompts[w.kind][: w.requests]:
                    begun = time.perf_counter()
                    got += generate([prompt], w.max_tokens)
                    latencies.append((time.perf_counter() - begun) / w.max_tokens)
                figures[(method, w.name)].append(1000 * sum(latencies) / len(latencies))
                tokens[(method, w.name)] = got
    for method, engine in engines.items():
        delta = {k: v - before[method][k] for k, v in engine_counters(engine)().items()}
        for w in workloads:
            rounds_ms = figures[(method, w.name)]
            line: dict[str, Any] = {
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": machine(),
                "engine": "radixserve",
                "method": method,
                "workload": w.name,
                "batch": 1,
                "requests": w.requests,
                "alternated": True,
                "rounds": [round(f, 3) for f in rounds_ms],
                "ms_per_token": round(statistics.median(rounds_ms), 3),
                "differ_from_none": sum(
                    a != b for a, b in zip(tokens[(method, w.name)], tokens.get(("none", w.name), []), strict=False)
                ),
            }
            if delta.get("proposed"):  # over both workloads: the counters are the engine's
                line["kept_share"] = round(delta["accepted"] / delta["proposed"], 3)
                line["tokens_per_verify"] = round(1 + delta["accepted"] / max(delta["verify_steps"], 1), 2)
            print(json.dumps(line), flush=True)
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")


def vllm_side(ns: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(ns.out.with_name("requests.json").read_text())
    target, draft = ns.models / "target", ns.models / "draft"
    k = ns.num_draft_tokens
    configs: dict[str, dict[str, Any] | None] = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 12},
        "draft": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k},
        "eagle": {"method": "eagle", "model": str(ns.models / "eagle"), "num_speculative_tokens": k},
        "eagle3": {"method": "eagle3", "model": str(ns.models / "eagle3"), "num_speculative_tokens": k},
    }
    reference: dict[str, list[list[int]]] = {}
    for method in ns.methods:
        try:
            llm = LLM(
                model=str(target), dtype="float32", seed=0, max_model_len=2048, speculative_config=configs[method]
            )
        except Exception as exc:  # its CPU build may not speculate: say so, and go on
            line = {"engine": "vllm", "method": method, "error": f"{type(exc).__name__}: {exc}"[:500]}
            print(json.dumps(line), flush=True)
            with ns.out.open("a") as f:
                f.write(json.dumps(line) + "\n")
            continue

        def generate(batch: list[list[int]], max_tokens: int, llm: Any = llm) -> list[list[int]]:
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outputs]

        got = run_workloads("vllm", method, prompts, generate, dict, reference, ns.out, ns.rounds, selected(ns))
        if method == "none":
            reference = got
        del llm


def step_cost(ns: argparse.Namespace) -> None:
    """What a verify step costs against a decode step, per batch size: the figure behind
    ``--speculative-max-batch-size``. Requests of 300-token prompts decode on the target;
    a proposer that always proposes ``--num-draft-tokens`` tokens (kept or not, each
    step then computes k + 1 positions a request) against none. In this process, one
    scheduler at a time, 15 steps each after 3 of warm-up."""
    from transformers import AutoTokenizer

    from radixserve.config import ServerArgs
    from radixserve.hooks import hookimpl
    from radixserve.messages import GenerateRequest
    from radixserve.registry import PluginRegistry
    from radixserve.runtime.scheduling.scheduler import Scheduler
    from radixserve.sampling.params import SamplingParams
    from radixserve.speculative.base import DraftRequest, Proposer

    class Always(Proposer):
        name = "always"

        def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
            return [[3] * r.max_tokens for r in requests]

    class AlwaysPlugin:
        @hookimpl
        def register_speculative_proposers(self, register: Any) -> None:
            register(Always)

    registry = PluginRegistry()
    registry.register_plugin(AlwaysPlugin(), "always")
    target = str(ns.models / "target")
    prompts = json.loads(ns.out.with_name("requests.json").read_text())["continue"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    for batch in ns.step_cost_batches:
        ms = {}
        for method in ("none", "always"):
            spec = {"speculative_algorithm": method, "speculative_max_batch_size": batch} if method != "none" else {}
            args = ServerArgs(model_path=target, dtype="float32", max_total_tokens=1 << 16, **spec)
            scheduler = Scheduler(args, target, tokenizer, registry=registry)
            params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                ids = prompts[i % len(prompts)][:300]
                scheduler.add_request(GenerateRequest(rid=f"r{i}", input_ids=ids, sampling_params=params))
            while scheduler.waiting or scheduler.chunked_req:
                scheduler.step()
            for _ in range(3):
                scheduler.step()
            start = time.perf_counter()
            for _ in range(15):
                scheduler.step()
            ms[method] = (time.perf_counter() - start) / 15 * 1000
        line = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(),
            "step_cost": True,
            "batch": batch,
            "num_draft_tokens": ns.num_draft_tokens,
            "decode_ms": round(ms["none"], 2),
            "verify_ms": round(ms["always"], 2),
            "ratio": round(ms["always"] / ms["none"], 2),
        }
        print(json.dumps(line), flush=True)
        with ns.out.open("a") as f:
            f.write(json.dumps(line) + "\n")


def table(path: Path) -> None:
    """One row per workload: each engine and method, and the ratios to no speculation."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    runs = {(x["engine"], x["method"], x["workload"]): x for x in lines if "workload" in x}
    columns = sorted({(e, m) for e, m, _ in runs}, key=lambda c: (c[0], METHODS.index(c[1])))
    print("| workload | " + " | ".join(f"{e} {m}" for e, m in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for w in WORKLOADS:
        cells = []
        for engine, method in columns:
            run, base = runs.get((engine, method, w.name)), runs.get((engine, "none", w.name))
            if run is None:
                cells.append("-")
                continue
            figure = run["ms_per_token"] if w.batch == 1 else run["output_tok_per_s"]
            unit = " ms/tok" if w.batch == 1 else " tok/s"
            cell = f"{figure}{unit}"
            if base is not None and method != "none":
                ratio = (base["ms_per_token"] / figure) if w.batch == 1 else figure / base["output_tok_per_s"]
                cell += f" ({ratio:.2f}x)"
            if "tokens_per_verify" in run:
                cell += f", {run['tokens_per_verify']} tok/verify"
            if "kept_share" in run:
                cell += f", kept {run['kept_share']:.0%}"
            cells.append(cell)
        print(f"| {w.name} | " + " | ".join(cells) + " |")
    for x in (x for x in lines if "error" in x):
        print(f"\n{x['engine']} {x['method']}: {x['error']}")
    costs = [x for x in lines if x.get("step_cost")]
    if costs:
        print("\n| batch | decode step (ms) | verify step, k proposals each (ms) | ratio |\n|---|---|---|---|")
        for x in costs:
            print(f"| {x['batch']} | {x['decode_ms']} | {x['verify_ms']} (k={x['num_draft_tokens']}) | {x['ratio']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("radixserve", "vllm"), default="radixserve")
    parser.add_argument("--models", type=Path, default=DEFAULT_MODELS, help="train_speculative_models.py's --out-dir")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument(
        "--workloads", nargs="+", choices=[w.name for w in WORKLOADS], default=[w.name for w in WORKLOADS]
    )
    parser.add_argument("--rounds", type=int, default=3, help="measured runs of each workload (the median is kept)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_speculative.jsonl"))
    parser.add_argument("--table", type=Path, default=None, help="print the table of a results file and exit")
    parser.add_argument(
        "--alternate",
        action="store_true",
        help="batch 1 only, every method's engine running at once and taking turns each round (a drifting machine)",
    )
    parser.add_argument(
        "--step-cost", action="store_true", help="time a verify step against a decode step per batch size, then exit"
    )
    parser.add_argument("--step-cost-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ns = parser.parse_args()
    if ns.table is not None:
        table(ns.table)
    elif ns.step_cost:
        step_cost(ns)
    elif ns.engine == "vllm":
        vllm_side(ns)
    else:
        radixserve_side(ns)


if __name__ == "__main__":
    main()
