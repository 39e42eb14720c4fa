"""Scheduler time per decode step outside the model forward and sampling (issue 8).

    python benchmarks/bench_scheduler_overhead.py                  # batch 128, 7 runs of 50 decode steps
    python benchmarks/bench_scheduler_overhead.py --profile        # plus cProfile's top functions of one run

A tiny random-weight 2-layer Llama (hidden 64) so that a decode step is mostly
scheduler work; ``--batch`` requests with prompts of 128-512 random tokens are
prefilled, then ``--steps`` decode steps are timed in the in-process Scheduler
(overlap off, so nothing hides the host work). Per step: the wall time of
``Scheduler.step`` minus the time inside ``ModelWorker._run`` (forward,
sampling and their host copies). Reported: median and range over ``--runs``
runs of each run's mean per step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import tempfile
import time

import torch
from transformers import AutoTokenizer

from radixserve.config import ServerArgs
from radixserve.messages import GenerateRequest
from radixserve.runtime.execution.model_worker import ModelWorker
from radixserve.runtime.scheduling.scheduler import Scheduler
from radixserve.sampling.params import SamplingParams
from radixserve.testing.tiny_models import build_tiny_model


def one_run(model_dir: str, batch: int, steps: int, seed: int, profile: bool) -> float:
    args = ServerArgs(
        model_path=model_dir,
        max_total_tokens=batch * (512 + steps + 16),
        max_running_requests=batch,
        disable_overlap_schedule=True,
    )
    scheduler = Scheduler(args, model_dir, AutoTokenizer.from_pretrained(model_dir))
    rng = random.Random(seed)
    for i in range(batch):
        prompt = [rng.randrange(3, scheduler.runner.vocab_size) for _ in range(rng.randint(128, 512))]
        scheduler.add_request(
            GenerateRequest(
                rid=f"r{i}",
                input_ids=prompt,
                sampling_params=SamplingParams(temperature=0, max_new_tokens=steps + 8, ignore_eos=True),
            )
        )
    while scheduler.waiting or scheduler.chunked_req:  # prefill everything first
        scheduler.step()
    assert len(scheduler.running) == batch, f"only {len(scheduler.running)} of {batch} requests are decoding"

    in_model = 0.0
    run_model = ModelWorker._run

    def timed_run(worker, work):
        nonlocal in_model
        start = time.perf_counter()
        try:
            return run_model(worker, work)
        finally:
            in_model += time.perf_counter() - start

    ModelWorker._run = timed_run
    profiler = cProfile.Profile() if profile else None
    try:
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        for _ in range(steps):
            scheduler.step()
        total = time.perf_counter() - start
        if profiler:
            profiler.disable()
    finally:
        ModelWorker._run = run_model
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return (total - in_model) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="cProfile one extra run and print its top functions")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(
            build_tiny_model(
                tmp,
                hidden_size=64,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=128,
                max_position_embeddings=1024,
            )
        )
        per_step = [one_run(model_dir, args.batch, args.steps, seed, False) for seed in range(args.runs)]
        if args.profile:
            one_run(model_dir, args.batch, args.steps, args.runs, True)
    ms = sorted(x * 1000 for x in per_step)
    print(
        f"scheduler time per decode step outside the forward and sampling, batch {args.batch}, "
        f"{args.steps} steps x {args.runs} runs: median {statistics.median(ms):.3f} ms "
        f"(range {ms[0]:.3f}-{ms[-1]:.3f})"
    )


if __name__ == "__main__":
    main()
