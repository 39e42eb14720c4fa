"""The ``radixserve bench offline|serving`` flags and what runs them."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.bench import datasets
from radixserve.bench.datasets import BenchRequest, TokenSource
from radixserve.bench.driver import Arrivals
from radixserve.bench.metrics import BenchSummary, RequestResult, format_report, summarize

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def build_requests(
    ns: argparse.Namespace, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """The measured requests and the warm-up ones."""

    def need_tokenizer() -> TokenSource:
        if tokenizer is None:
            raise ValueError(
                "tokenizer: the random and shared-prefix sets draw from the model's vocabulary; pass --tokenizer DIR"
            )
        return TokenSource(tokenizer, ns.prompt_format)

    if ns.dataset == "random":
        requests = datasets.random_requests(
            need_tokenizer(), ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.random_range_ratio, ns.seed
        )
    elif ns.dataset == "generated-shared-prefix":
        requests = datasets.shared_prefix_requests(
            need_tokenizer(),
            ns.gsp_num_groups,
            ns.gsp_prompts_per_group,
            ns.gsp_system_prompt_len,
            ns.gsp_question_len,
            ns.gsp_output_len,
            ns.seed,
        )
    else:
        requests = datasets.load_jsonl(ns.dataset_path, ns.jsonl_output_len, tokenizer)
    if ns.save_requests:
        datasets.save_jsonl(requests, ns.save_requests)
    warmup = []
    if ns.warmup_requests:
        if tokenizer is not None:
            warmup = datasets.warmup_requests(TokenSource(tokenizer), ns.warmup_requests, ns.seed)
        else:
            warmup = [
                BenchRequest(output_len=4, input_ids=r.input_ids, prompt=r.prompt, prompt_len=r.prompt_len)
                for r in requests[: ns.warmup_requests]
            ]
    return requests, warmup


class _Progress:
    def __init__(self, total: int, disable: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, disable=disable, desc="requests", file=sys.stderr)

    def __call__(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _record(ns: argparse.Namespace, summary: BenchSummary, results: list[RequestResult], extra: dict[str, Any]) -> None:
    title = f"radixserve bench {ns.bench_mode} ({ns.dataset})"
    print(format_report(title, summary))
    if ns.output_file:
        import torch

        config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(ns).items()}
        if config.get("api_key"):
            config["api_key"] = "<redacted>"
        line = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "mode": ns.bench_mode,
            "config": config,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            **extra,
            **summary,
        }
        with open(ns.output_file, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")
    if ns.plot:
        from radixserve.bench.plot import plot_results

        plot_results(results, ns.plot, title)


def _run_offline(ns: argparse.Namespace) -> BenchSummary:
    from radixserve import Engine
    from radixserve.bench.offline import run_offline
    from radixserve.config import ServerArgs

    args = ServerArgs.from_cli_args(ns)
    with Engine(**{name: getattr(args, name) for name in ServerArgs.field_names()}) as engine:
        requests, warmup = build_requests(ns, engine.tokenizer)
        progress = _Progress(len(requests), ns.disable_tqdm)
        try:
            results, duration, peak = run_offline(
                engine,
                requests,
                warmup,
                Arrivals(ns.request_rate, ns.max_concurrency, ns.seed),
                ns.ignore_eos,
                progress,
            )
        finally:
            progress.close()
        info = engine.server_info()
    summary = summarize(results, duration, peak)
    _record(
        ns,
        summary,
        results,
        {"engine": "radixserve", "model_path": engine.model_path, "backends": info.get("backends")},
    )
    return summary


def _load_tokenizer(path: str | None) -> PreTrainedTokenizerBase | None:
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _run_serving(ns: argparse.Namespace) -> BenchSummary:
    from radixserve.bench.serving import first_model, run_serving, server_info, server_pids

    base_url = ns.base_url.rstrip("/")
    info = asyncio.run(server_info(base_url, ns.api_key))
    model = ns.model or asyncio.run(first_model(base_url, ns.api_key))
    tokenizer_path = ns.tokenizer or (info or {}).get("model_path")
    if tokenizer_path is None and ns.model and Path(ns.model).is_dir():
        tokenizer_path = ns.model
    requests, warmup = build_requests(ns, _load_tokenizer(tokenizer_path))
    progress = _Progress(len(requests), ns.disable_tqdm)
    try:
        results, duration, peak = asyncio.run(
            run_serving(
                base_url,
                model,
                requests,
                warmup,
                Arrivals(ns.request_rate, ns.max_concurrency, ns.seed),
                ns.ignore_eos,
                ns.api_key,
                server_pids(base_url, info),
                progress,
            )
        )
    finally:
        progress.close()
    summary = summarize(results, duration, peak)
    is_radixserve = info is not None and "pids" in info and "served_model_name" in info
    _record(
        ns,
        summary,
        results,
        {"engine": "radixserve" if is_radixserve else "other", "base_url": base_url, "model": model},
    )
    return summary


def check_args(ns: argparse.Namespace) -> None:
    """Flag errors that need no engine, raised before one is started."""
    if ns.dataset == "jsonl" and not ns.dataset_path:
        raise ValueError("dataset_path: --dataset jsonl needs --dataset-path FILE")
    if ns.dataset_path and not Path(ns.dataset_path).is_file():
        raise ValueError(f"dataset_path: no such file {ns.dataset_path!r}")
    if not 0 <= ns.random_range_ratio <= 1:
        raise ValueError(f"random_range_ratio: must be in [0, 1], got {ns.random_range_ratio}")
    Arrivals(ns.request_rate, ns.max_concurrency, ns.seed)
    if ns.plot:
        from radixserve.bench.plot import require_matplotlib

        require_matplotlib()


def run_bench(ns: argparse.Namespace) -> int:
    """Exit code 0 when every request completed, 1 otherwise; call ``check_args`` first."""
    summary = _run_offline(ns) if ns.bench_mode == "offline" else _run_serving(ns)
    return 0 if summary["failed"] == 0 and summary["completed"] > 0 else 1
