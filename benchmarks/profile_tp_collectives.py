"""What share of a tensor-parallel decode step goes to the collectives, from a
profile of a warm Engine (torch.profiler through Engine.start_profile, one trace
per rank): every ``c10d``/``gloo`` all-reduce or all-gather event, against the
span of the decode steps (``radixserve.decode[bs=N]`` annotations).

    python benchmarks/profile_tp_collectives.py --model DIR --dtype bfloat16 --tp-size 2 --batch 16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from radixserve.engine import Engine


def collective_share(trace: dict, batch: int) -> tuple[int, float, float]:
    """(decode steps, median ms per step, share of the steps' span in collectives)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == f"radixserve.decode[bs={batch}]")
    if len(steps) < 2:
        raise SystemExit(f"fewer than two decode steps at batch {batch} in the trace")
    start, end = steps[0][0], steps[-1][0]  # from the first step's launch to the last one's
    periods = [b[0] - a[0] for a, b in zip(steps, steps[1:], strict=False)]
    names = ("all_reduce", "allreduce", "all_gather", "allgather")
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if any(n in e["name"].lower() for n in names) and start <= e["ts"] < end
    )
    busy, last = 0.0, start  # the union of the collectives' intervals
    for a, b in spans:
        a = max(a, last)
        if b > a:
            busy, last = busy + b - a, b
    return len(steps), statistics.median(periods) / 1000, busy / (end - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(256)] for _ in range(args.batch)]
    params = {"temperature": 0.0, "max_new_tokens": args.steps + 20, "ignore_eos": True}
    with Engine(model_path=args.model, dtype=args.dtype, tp_size=args.tp_size, log_level="warning") as engine:
        engine.generate(input_ids=prompts, sampling_params=params)  # warm-up
        with tempfile.TemporaryDirectory() as out:
            engine.start_profile(output_dir=out, num_steps=args.steps)
            engine.generate(input_ids=prompts, sampling_params=params)
            engine.stop_profile()
            for path in sorted(Path(out).rglob("*.json")):
                steps, step_ms, share = collective_share(json.loads(path.read_text()), args.batch)
                print(
                    f"{path.name}: {steps} decode steps at batch {args.batch}, {step_ms:.2f} ms per step, "
                    f"{share:.1%} of the span in collectives"
                )


if __name__ == "__main__":
    main()
