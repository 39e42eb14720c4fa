"""Multi-LoRA throughput: one workload spread over 1, 4 and 16 adapters of a rank,
against the base model alone, radixserve and vLLM's CPU engine on the same
token-id requests and the same adapters (random PEFT adapters over a random
Llama: throughput does not depend on what the weights learned).

    python benchmarks/bench_lora.py --out /tmp/lora.jsonl                 # radixserve (builds model, adapters)
    for row in 0 1 2 3 4 5 6 7 8 9 10; do    # vLLM: one engine per process (it holds its memory)
        VLLM_CPU_OMP_THREADS_BIND=0-1 ~/.cache/radixserve-bench/vllm-venv/bin/python \\
            benchmarks/bench_lora.py --engine vllm --row $row --out /tmp/lora.jsonl; done
    python benchmarks/bench_lora.py --table /tmp/lora.jsonl

The workload: ``--requests`` requests at once, prompts of ragged lengths (64 to 256
tokens, distinct), ``--max-tokens`` output tokens each (greedy, ``ignore_eos``); request
``i`` uses adapter ``i mod N``. Rows: ``base`` (LoRA off), ``base+lora`` (LoRA on, every
request on the base model: what enabling LoRA costs), and each (N, rank). Each row runs
once unmeasured, then ``--rounds`` times; the median output tokens per second. Each run
appends one JSON line to ``--out``.

Only the standard library (and sibling scripts that import only it) is imported at
the top: the vLLM side runs in vLLM's own virtualenv, which has no radixserve.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench_speculative import machine
from compare_vllm_cpu import MODELS as VLLM_COMPARISON_MODELS

DEFAULT_DIR = Path.home() / ".cache/radixserve-bench/lora"
# compare_vllm_cpu.py's Llama shape, and one twice as wide. A decode step reads every
# weight once, and each adapter a request uses too: 16 adapters of rank 16 weigh 41% of
# the narrow model's weights, 21% of the wide one's (0.6% each of a Llama-3-8B layer's).
MODELS = {
    "llama": VLLM_COMPARISON_MODELS["llama"],
    "wide": dict(
        arch="llama",
        hidden_size=2048,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=5632,
        vocab_size=4096,
        max_position_embeddings=2048,
    ),
}
COUNTS = (1, 4, 16)


def build(root: Path, shape: str, ranks: list[int]) -> None:
    """The model and ``max(COUNTS)`` adapters of each rank (every target module), once."""
    from radixserve.checkpoints.random_adapter import build_random_adapter
    from radixserve.testing.tiny_models import build_tiny_model

    if not (root / "model" / "config.json").is_file():
        build_tiny_model(root / "model", **MODELS[shape])
    for rank in ranks:
        for i in range(max(COUNTS)):
            path = adapter_path(root, rank, i)
            if not (path / "adapter_config.json").is_file():
                build_random_adapter(root / "model", path, rank=rank, seed=1000 * rank + i, strength=0.3)


def adapter_path(root: Path, rank: int, i: int) -> Path:
    return root / f"r{rank}" / f"a{i}"


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(64, 256))] for _ in range(n)]


def rows(ranks: list[int]) -> list[tuple[str, int, int]]:
    """``(label, adapters, rank)``: 0 adapters is the base model (rank 0: LoRA off)."""
    out = [("base", 0, 0)]
    out += [(f"base+lora r{rank}", 0, rank) for rank in ranks[:1]]
    return out + [(f"{n} adapters r{rank}", n, rank) for rank in ranks for n in COUNTS]


def selected(ns: argparse.Namespace) -> list[tuple[str, int, int]]:
    every = rows(ns.ranks)
    return every if ns.row is None else every[ns.row : ns.row + 1]


def measure(
    engine: str,
    label: str,
    count: int,
    rank: int,
    run: Callable[[], list[list[int]]],
    ns: argparse.Namespace,
) -> None:
    run()  # unmeasured: first-call work
    figures, tokens = [], []
    for _ in range(ns.rounds):
        start = time.perf_counter()
        tokens = run()
        figures.append(sum(len(t) for t in tokens) / (time.perf_counter() - start))
    line: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "engine": engine,
        "shape": ns.shape,
        "row": label,
        "adapters": count,
        "rank": rank,
        "requests": ns.requests,
        "max_tokens": ns.max_tokens,
        "dtype": ns.dtype,
        "lora_backend": ns.lora_backend if engine == "radixserve" else None,
        "rounds": [round(f, 1) for f in figures],
        "output_tok_per_s": round(statistics.median(figures), 1),
        "output_tokens": sum(len(t) for t in tokens),
    }
    print(json.dumps(line), flush=True)
    with ns.out.open("a") as f:
        f.write(json.dumps(line) + "\n")


def radixserve_side(ns: argparse.Namespace) -> None:
    from radixserve import Engine

    build(ns.dir, ns.shape, ns.ranks)
    batch = prompts(ns.requests, MODELS[ns.shape]["vocab_size"])
    params = {"max_new_tokens": ns.max_tokens, "temperature": 0.0, "ignore_eos": True}
    for label, count, rank in selected(ns):
        lora: dict[str, Any] = {}
        names: list[str | None] = [None]
        if rank:
            paths = [f"a{i}={adapter_path(ns.dir, rank, i)}" for i in range(count)]
            lora = {"enable_lora": True, "lora_paths": paths, "max_lora_rank": rank, "lora_backend": ns.lora_backend}
            lora["max_loras_per_batch"] = max(count, 1)
            names = [f"a{i}" for i in range(count)] or [None]
        with Engine(model_path=str(ns.dir / "model"), dtype=ns.dtype, log_level="warning", **lora) as engine:

            def run(engine: Engine = engine, names: list[str | None] = names) -> list[list[int]]:
                adapters = [names[i % len(names)] for i in range(len(batch))]
                results = engine.generate(input_ids=batch, sampling_params=params, lora_path=adapters)
                return [r["output_ids"] for r in results]

            measure("radixserve", label, count, rank, run, ns)


def vllm_side(ns: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(ns.requests, MODELS[ns.shape]["vocab_size"])]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=ns.max_tokens)
    for label, count, rank in selected(ns):
        kw: dict[str, Any] = {}
        if rank:
            slots = max(count, 1)
            kw = {"enable_lora": True, "max_loras": slots, "max_lora_rank": rank, "max_cpu_loras": slots}
        try:
            # The KV cache's share of the machine's memory (vLLM's CPU backend reads it so).
            llm = LLM(
                model=str(ns.dir / "model"),
                seed=0,
                max_model_len=2048,
                gpu_memory_utilization=0.3,
                dtype=ns.dtype,
                **kw,
            )
        except Exception as exc:  # its CPU build may not serve LoRA: say so, and go on
            line = {"engine": "vllm", "shape": ns.shape, "row": label, "error": f"{type(exc).__name__}: {exc}"[:500]}
            print(json.dumps(line), flush=True)
            with ns.out.open("a") as f:
                f.write(json.dumps(line) + "\n")
            continue
        requests = [LoRARequest(f"a{i}", i + 1, str(adapter_path(ns.dir, rank, i))) for i in range(count)] or [None]

        def run(llm: Any = llm, requests: list[Any] = requests) -> list[list[int]]:
            lora = [requests[i % len(requests)] for i in range(len(batch))]
            outputs = llm.generate(batch, params, lora_request=lora if lora[0] is not None else None, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outputs]

        measure("vllm", label, count, rank, run, ns)
        del llm


def table(path: Path) -> None:
    """One row per (adapters, rank): each engine's tok/s and its share of its own base."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    runs = {(x["engine"], x["shape"], x["row"]): x for x in lines if "row" in x and "error" not in x}
    engines = sorted({e for e, _, _ in runs})
    labels = list(dict.fromkeys((shape, row) for _, shape, row in runs))
    print("| model | workload | " + " | ".join(engines) + " |")
    print("|---|---|" + "---|" * len(engines))
    for shape, label in labels:
        cells = []
        for engine in engines:
            run, base = runs.get((engine, shape, label)), runs.get((engine, shape, "base"))
            if run is None:
                cells.append("-")
                continue
            cell = f"{run['output_tok_per_s']} tok/s"
            if base is not None and label != "base":
                cell += f" ({run['output_tok_per_s'] / base['output_tok_per_s']:.0%} of base)"
            cells.append(cell)
        print(f"| {shape} | {label} | " + " | ".join(cells) + " |")
    for x in (x for x in lines if "error" in x):
        print(f"\n{x['engine']} {x['row']}: {x['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("radixserve", "vllm"), default="radixserve")
    parser.add_argument("--shape", choices=sorted(MODELS), default="llama")
    parser.add_argument("--dir", type=Path, default=None, help="where the model and adapters are built")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="both engines' --dtype (auto: each engine's own choice)")
    parser.add_argument("--lora-backend", default="auto", help="radixserve's --lora-backend (auto: timed)")
    parser.add_argument("--row", type=int, default=None, help="run only this row (0: base, 1: base+lora, ...)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_lora.jsonl"))
    parser.add_argument("--table", type=Path, default=None, help="print the table of a results file and exit")
    ns = parser.parse_args()
    ns.dir = ns.dir or DEFAULT_DIR / ns.shape
    if ns.table is not None:
        table(ns.table)
    elif ns.engine == "vllm":
        vllm_side(ns)
    else:
        radixserve_side(ns)


if __name__ == "__main__":
    main()
