"""The ``radixserve bench offline|serving`` flags. Apart from ``bench.cli`` (what
runs them), so that building the ``radixserve`` parser for any command imports
neither numpy nor transformers."""

from __future__ import annotations

import argparse
import math

from radixserve.config import ServerArgs

DATASETS = ("random", "generated-shared-prefix", "jsonl")
PROMPT_FORMATS = ("ids", "text")  # random token ids, or those ids decoded to text


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", default="random", choices=DATASETS)
    data.add_argument(
        "--prompt-format",
        default="ids",
        choices=PROMPT_FORMATS,
        help="random token ids, or those ids decoded to text (random and shared-prefix sets)",
    )
    data.add_argument("--num-prompts", type=int, default=64, help="requests in the random set")
    data.add_argument("--random-input-len", type=int, default=512)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="lengths uniform in [len * ratio, len]; 1.0 gives fixed lengths",
    )
    data.add_argument("--gsp-num-groups", type=int, default=8, help="shared system prompts")
    data.add_argument("--gsp-prompts-per-group", type=int, default=16)
    data.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    data.add_argument("--gsp-question-len", type=int, default=64)
    data.add_argument("--gsp-output-len", type=int, default=32)
    data.add_argument(
        "--dataset-path", default=None, help='JSONL: {"prompt": str} or {"input_ids": [...]}, optional "output_len"'
    )
    data.add_argument("--jsonl-output-len", type=int, default=128, help="output length for lines without one")
    data.add_argument(
        "--save-requests",
        default=None,
        metavar="FILE.jsonl",
        help="also write the request set as JSONL, to replay it with --dataset jsonl or other tools",
    )
    run = parser.add_argument_group("run")
    run.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)"
    )
    run.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    run.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="short unmeasured requests sent first, on prompts of their own; with no tokenizer "
        "(a JSONL set against a foreign server) the first prompts, which may then hit the cache",
    )
    run.add_argument("--seed", type=int, default=0, help="seeds the request set and the arrivals")
    run.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly each request's output length (on by default, so runs compare)",
    )
    run.add_argument("--output-file", default=None, metavar="FILE.jsonl", help="append one JSON line per run")
    run.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="latency CDFs and throughput over time (needs matplotlib: radixserve[bench])",
    )
    run.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    run.add_argument("--label", default=None, help="free text kept in the JSON line, to tell runs apart")


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``radixserve bench``: called by ``radixserve.cli`` with its subparsers."""
    bench = sub.add_parser("bench", help="benchmark the Engine offline or any OpenAI-compatible server")
    modes = bench.add_subparsers(dest="bench_mode", required=True)
    offline = modes.add_parser("offline", help="the Engine in this process; every ServerArgs flag applies")
    _add_common_args(offline)
    ServerArgs.add_cli_args(offline)
    offline.set_defaults(log_level="warning")
    serving = modes.add_parser("serving", help="streaming /v1/completions against a running server")
    _add_common_args(serving)
    serving.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:30000")
    serving.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    serving.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory for drawing prompts (default: radixserve's model_path, "
        "else --model when it is a directory)",
    )
    serving.add_argument("--api-key", default=None)
