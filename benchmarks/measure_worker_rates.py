"""The rate curves of one real worker, for the fleet simulator's measured device class
(``radixserve.router.simulation.devices``): prefill seconds for one prompt of n tokens,
and decode seconds per step at batch size B, on the llama benchmark model
(``bench_offline.MODEL``), fitted to ``time = fixed + per_unit * units``.

    python benchmarks/measure_worker_rates.py

Each point is the best of ``--repeats`` (the machine is shared and noisy); a decode
step's time is (B requests generating 1 + S tokens - the same generating 1) / S.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_offline import MODEL as BENCH_MODEL  # this script's folder is on sys.path when it runs

from radixserve import Engine
from radixserve.testing.tiny_models import build_tiny_model

MODEL: dict[str, Any] = {**BENCH_MODEL, "max_position_embeddings": 4096}  # room for the longest prefill


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(16, MODEL["vocab_size"], (n, length), generator=gen).tolist()


def timed(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``seconds = fixed + per_unit * units``; (fixed, per_unit)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return max(0.0, my - slope * mx), slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    seed = iter(range(1_000_000))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", "llama", **MODEL)
        with Engine(model_path=str(model_dir), max_total_tokens=32768, log_level="warning") as engine:
            engine.generate(input_ids=random_prompts(1, 8, next(seed)), sampling_params={"max_new_tokens": 4})
            prefill = []
            for length in args.prefill_lengths:
                best = min(timed(engine, random_prompts(1, length, next(seed)), 1) for _ in range(args.repeats))
                prefill.append((length, best))
                print(f"prefill {length:5d} tokens: {best * 1000:8.1f} ms", flush=True)
            decode = []
            for batch in args.batch_sizes:
                steps = args.decode_steps

                def step_time(batch: int = batch, steps: int = steps) -> float:
                    prompts = random_prompts(batch, 32, next(seed))
                    return (timed(engine, prompts, 1 + steps) - timed(engine, prompts, 1)) / steps

                best = min(step_time() for _ in range(args.repeats))
                decode.append((batch, best))
                print(f"decode batch {batch:3d}: {best * 1000:8.2f} ms/step", flush=True)
    prefill_fixed, per_token = fit(prefill)
    decode_fixed, per_request = fit(decode)
    print(
        json.dumps(
            {
                "prefill_fixed_s": round(prefill_fixed, 5),
                "prefill_s_per_token": round(per_token, 7),
                "decode_fixed_s": round(decode_fixed, 5),
                "decode_s_per_request": round(per_request, 6),
            }
        )
    )


if __name__ == "__main__":
    main()
