"""Greedy outputs of the in-process Scheduler, written as JSON, to compare two
trees bit for bit (a refactor must not change a token or a logprob bit).

    # the test architectures in six scheduler configurations
    PYTHONPATH=<tree>/core:<tree>/plugins python benchmarks/dump_outputs.py tiny OUT.json
    # a saved request set (radixserve bench --save-requests) on a real model
    PYTHONPATH=<tree>/core:<tree>/plugins python benchmarks/dump_outputs.py requests OUT.json \\
        --model DIR --dtype bfloat16 --requests W1.jsonl

Run it on both trees, then ``cmp`` the two files.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from radixserve.checkpoints.random_model import build_tiny_model
from radixserve.config import ServerArgs
from radixserve.messages import GenerateRequest
from radixserve.runtime.scheduling.scheduler import Scheduler
from radixserve.sampling.params import SamplingParams

ARCHITECTURES = {"llama": dict(arch="llama"), "qwen2": dict(arch="qwen2"), "qwen3_moe": dict(arch="qwen3_moe")}
CONFIGS = {
    "default": {},
    "chunk48": dict(chunked_prefill_size=48),
    "page16": dict(page_size=16),
    "nocache": dict(disable_radix_cache=True),
    "small_pool": dict(max_total_tokens=1200, page_size=4, chunked_prefill_size=64),  # retracts
    "no_overlap": dict(disable_overlap_schedule=True, page_size=8, chunked_prefill_size=40),
}


def run(scheduler: Scheduler, requests: list[tuple[list[int], int]]) -> dict:
    """Token ids and the bits of every output logprob, per request."""
    for i, (prompt, max_new) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
        scheduler.add_request(
            GenerateRequest(rid=f"r{i}", input_ids=prompt, sampling_params=params, return_logprob=True)
        )
    out: dict = {}
    while scheduler.has_work():
        for o in scheduler.step():
            r = out.setdefault(o.rid, {"ids": [], "logprob_bits": []})
            r["ids"] += o.new_token_ids
            r["logprob_bits"] += [struct.pack("<d", lp).hex() for lp, _ in o.output_token_logprobs]
            r["finish"] = o.finish_reason.type if o.finish_reason else None
    assert scheduler.check_memory(), scheduler.stats()
    return out


def tiny_requests(seed: int = 0) -> list[tuple[list[int], int]]:
    """24 ragged prompts, half sharing a 90-token stem, 8-47 new tokens each."""
    rng = random.Random(seed)
    stem = [rng.randrange(5, 500) for _ in range(90)]
    requests = []
    for i in range(24):
        body = [rng.randrange(5, 500) for _ in range(rng.randrange(8, 200))]
        requests.append(((stem[: rng.randrange(0, 90)] if i % 2 else []) + body, 8 + (i * 7) % 40))
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["tiny", "requests"])
    parser.add_argument("output")
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", help="a JSONL file of {input_ids, output_len}")
    args = parser.parse_args()
    results = {}
    if args.mode == "tiny":
        with tempfile.TemporaryDirectory() as tmp:
            for name, kwargs in ARCHITECTURES.items():
                model = build_tiny_model(Path(tmp) / name, **kwargs)
                tokenizer = AutoTokenizer.from_pretrained(model)
                for config, flags in CONFIGS.items():
                    server_args = ServerArgs(model_path=str(model), **{"max_total_tokens": 8192, **flags})
                    results[f"{name}/{config}"] = run(Scheduler(server_args, str(model), tokenizer), tiny_requests())
                    print(f"{name}/{config}: done", flush=True)
    else:
        requests = [json.loads(line) for line in Path(args.requests).read_text().splitlines() if line.strip()]
        server_args = ServerArgs(model_path=args.model, dtype=args.dtype, random_seed=0)
        scheduler = Scheduler(server_args, args.model, AutoTokenizer.from_pretrained(args.model))
        results["requests"] = run(scheduler, [(r["input_ids"], r["output_len"]) for r in requests])
    Path(args.output).write_text(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
