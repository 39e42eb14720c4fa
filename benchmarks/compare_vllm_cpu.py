"""Helpers for ``benchmarks/compare_vllm_cpu.sh`` (read that first).

    python compare_vllm_cpu.py models DIR [NAME...]   build the random-weight models (radixserve's Python)
    python compare_vllm_cpu.py vllm-offline ...       replay a request JSONL through vLLM's LLM (vLLM's venv)
    python compare_vllm_cpu.py table RESULTS.jsonl    print both engines side by side, with the ratios

Only the standard library is imported at the top: each subcommand runs under a
different interpreter and imports what it needs itself. The vLLM side reads the
very JSONL that ``radixserve bench --save-requests`` wrote, so both engines get
identical token-id requests, and writes a JSON line with the same keys as
``radixserve bench --output-file``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

# Two shapes, so speed is not tuned to one: the issue's Llama, and a deeper,
# narrower Qwen2 (qkv bias, 8 query heads per KV head); then two of the newer
# families at the Llama's width: a Mixtral (8 experts, 2 per token) and a Gemma 2
# (sliding-window layers of 256 tokens interleaved with global ones, attention
# and final logit caps). Built on demand: the default run keeps the first two.
MODELS = {
    "llama": dict(
        arch="llama",
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=8,
        intermediate_size=2816,
        vocab_size=4096,
        max_position_embeddings=2048,
    ),
    "qwen2": dict(
        arch="qwen2",
        hidden_size=512,
        num_layers=24,
        num_heads=16,
        num_kv_heads=2,
        intermediate_size=1408,
        vocab_size=4096,
        max_position_embeddings=2048,
    ),
    "mixtral": dict(
        arch="mixtral",
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=8,
        intermediate_size=1408,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=4096,
        max_position_embeddings=2048,
    ),
    "gemma2": dict(
        arch="gemma2",
        hidden_size=1024,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=2816,
        vocab_size=4096,
        max_position_embeddings=2048,
        sliding_window=256,
        query_pre_attn_scalar=128,
        tie_word_embeddings=True,
    ),
}


def build_models(out: Path, names: list[str]) -> None:
    from radixserve.testing.tiny_models import build_tiny_model

    for name in names:
        recipe = MODELS[name]
        if (out / name / "config.json").is_file():
            print(f"model {name}: reusing {out / name}")
            continue
        build_tiny_model(out / name, **recipe)
        print(f"model {name}: built {out / name}")


def _load_memory_module():
    """radixserve's /proc sampler, loaded by path: vLLM's venv does not install radixserve."""
    path = Path(__file__).resolve().parents[1] / "core" / "radixserve" / "bench" / "memory.py"
    spec = importlib.util.spec_from_file_location("radixserve_bench_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vllm_offline(ns: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    memory = _load_memory_module()
    requests = [json.loads(line) for line in Path(ns.requests).read_text().splitlines() if line.strip()]
    llm = LLM(
        model=ns.model, dtype=ns.dtype, enable_prefix_caching=ns.prefix_caching, seed=0, max_model_len=ns.max_model_len
    )
    prompts = [TokensPrompt(prompt_token_ids=r["input_ids"]) for r in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["output_len"]) for r in requests]
    llm.generate([TokensPrompt(prompt_token_ids=[11, 12, 13, 14])], SamplingParams(max_tokens=4), use_tqdm=False)
    with memory.PeakRSS(memory.engine_pids()) as peak:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        duration = time.perf_counter() - start
    input_tokens = sum(len(r["input_ids"]) for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = [o.num_cached_tokens for o in outputs]
    line = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mode": "offline",
        "engine": "vllm",
        "config": {
            "label": ns.label,
            "model_path": ns.model,
            "dtype": ns.dtype,
            "dataset_path": ns.requests,
            "prefix_caching": ns.prefix_caching,
        },
        "completed": len(outputs),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(outputs) / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "cache_hit_rate": sum(cached) / input_tokens if None not in cached else None,
        "peak_rss_mib": peak.bytes / 2**20 if peak.bytes else None,
    }
    print(f"vllm {ns.label}: {output_tokens} output tokens in {duration:.2f} s, {line['output_throughput']:.1f} tok/s")
    with open(ns.output_file, "a") as f:
        f.write(json.dumps(line) + "\n")


def table(path: str) -> None:
    """One line per label (model, dtype, workload) and round: radixserve against the
    other engine's run of the same round (the n-th run of each under that label);
    with several rounds, the median of their ratios. Then radixserve's radix cache
    on (the median of its runs) against off."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            side = "ours" if row["engine"] == "radixserve" else "theirs"
            runs.setdefault((row["config"]["label"], side), []).append(row)
    labels = list(dict.fromkeys(label for label, _ in runs))
    cell = lambda row: f"{row['output_throughput']:.1f} ({row['duration_s']:.1f} s)" if row else "n/a"  # noqa: E731
    speedup = lambda a, b: a["output_throughput"] / b["output_throughput"]  # noqa: E731
    print(f"{'output tok/s (duration)':<34}{'radixserve':>20}{'vLLM-CPU':>20}{'ratio':>8}")
    for label in labels:
        if label.endswith(" radix-off"):
            continue
        ours, theirs = runs.get((label, "ours"), []), runs.get((label, "theirs"), [])
        ratios = []
        for n in range(max(len(ours), len(theirs))):
            a = ours[n] if n < len(ours) else None
            b = theirs[n] if n < len(theirs) else None
            ratios += [speedup(a, b)] if a and b else []
            print(
                f"{label if n == 0 else '':<34}{cell(a):>20}{cell(b):>20}"
                f"{f'{speedup(a, b):.2f}x' if a and b else 'n/a':>8}"
            )
            for name, row in (("radixserve", a), ("vLLM", b)):
                if row and row["mode"] == "serving":
                    print(
                        f"    {name}: TTFT median {row['ttft_ms']['median']:.0f} ms, "
                        f"ITL median {row['itl_ms']['median']:.1f} ms, failed {row['failed']}"
                    )
        if len(ratios) > 1:
            print(f"{f'  median of {len(ratios)} rounds':<74}{statistics.median(ratios):>7.2f}x")
    off_labels = [label for label in labels if label.endswith(" radix-off")]
    if off_labels:
        print(f"\n{'radixserve radix cache':<34}{'on (median)':>20}{'off':>20}{'ratio':>8}")
    for label in off_labels:
        on_runs = runs.get((label[: -len(" radix-off")], "ours"), [])
        off = runs[label, "ours"][-1]
        if not on_runs:
            print(f"{label[: -len(' radix-off')]:<34}{'n/a':>20}{cell(off):>20}{'n/a':>8}")
            continue
        on = sorted(on_runs, key=lambda row: row["output_throughput"])[(len(on_runs) - 1) // 2]
        print(f"{label[: -len(' radix-off')]:<34}{cell(on):>20}{cell(off):>20}{speedup(on, off):>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models")
    models.add_argument("out", type=Path)
    models.add_argument("names", nargs="*", choices=sorted(MODELS), help="default: all")
    vllm = sub.add_parser("vllm-offline")
    vllm.add_argument("--model", required=True)
    vllm.add_argument("--requests", required=True, help="JSONL written by radixserve bench --save-requests")
    vllm.add_argument("--dtype", required=True)
    vllm.add_argument("--label", required=True, help="the label of the radixserve run to compare with")
    vllm.add_argument("--output-file", required=True)
    vllm.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    vllm.add_argument("--max-model-len", type=int, default=2048)
    tab = sub.add_parser("table")
    tab.add_argument("results")
    ns = parser.parse_args()
    if ns.command == "models":
        build_models(ns.out, ns.names or list(MODELS))
    elif ns.command == "vllm-offline":
        vllm_offline(ns)
    else:
        table(ns.results)


if __name__ == "__main__":
    main()
