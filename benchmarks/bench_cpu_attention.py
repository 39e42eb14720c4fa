"""Per-layer attention time on ragged paged batches: torch_native vs torch_varlen vs cpu_paged.

    python benchmarks/bench_cpu_attention.py                      # bf16 and fp32, all shapes
    python benchmarks/bench_cpu_attention.py --dtypes bfloat16 --repeats 9 --only decode
    python benchmarks/bench_cpu_attention.py --backends torch_varlen,cpu_paged --timer cpu --threads 1
    python benchmarks/bench_cpu_attention.py --heads 16/2/32 --only decode   # qwen2's shape (GQA 8)
    python benchmarks/bench_cpu_attention.py --sliding-window 128 --logit-softcap 50   # Gemma 2's features

Model shape of the W1 workload (16 heads, 8 KV heads, head_dim 64; ``--heads``
picks another, e.g. 16/2/32 for qwen2's), page size 1,
slots scattered over the pool as the conformance kit lays them out. Decode
contexts are uniform in [100, 1500] (plus one W1- and one W2-like batch); extend covers ragged fresh prompts of
128-512 tokens, chunked prefills over a cached 1024-token prefix, and single
long prompts. Each number is the minimum over ``--repeats`` timed calls (the
machine is shared: the minimum is the least disturbed run); ``--timer cpu``
times the process's CPU time instead of the wall clock, which a crowded machine
disturbs less (with one thread it is the kernel's own time). ``plan`` is each
backend's ``init_forward_metadata`` (in the order of ``--backends``), paid
once per step for all layers; speedups are against the first backend.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace
from datetime import date

import torch

from radixserve.registry import get_registry
from radixserve.testing.conformance import AttentionCase, make_attention_inputs


def shapes(seed: int, heads: str) -> list[AttentionCase]:
    """The cases at ``heads`` = "num_heads/num_kv_heads/head_dim"."""
    h, kvh, d = (int(x) for x in heads.split("/"))
    rng = random.Random(seed)
    out = []
    for b in (1, 8, 32, 64, 128):
        seq = [rng.randint(100, 1500) for _ in range(b)]
        out.append(
            AttentionCase(f"decode B{b} ctx100-1500", "decode", 1, h, kvh, d, tuple(s - 1 for s in seq), (1,) * b)
        )
    # W1's decode (prompts 128-512 plus up to 256 generated) and W2's (1024 shared + 64 + up to 32).
    w1 = [rng.randint(128, 768) for _ in range(32)]
    out.append(AttentionCase("decode B32 ctx128-768 (W1)", "decode", 1, h, kvh, d, tuple(s - 1 for s in w1), (1,) * 32))
    w2 = [rng.randint(1088, 1120) for _ in range(128)]
    out.append(AttentionCase("decode B128 ctx~1100 (W2)", "decode", 1, h, kvh, d, tuple(s - 1 for s in w2), (1,) * 128))
    prompts = [rng.randint(128, 512) for _ in range(8)]
    out += [
        AttentionCase("extend 8 x 128-512", "extend", 1, h, kvh, d, (0,) * 8, tuple(prompts)),
        AttentionCase("extend 16 x (1024 + 64)", "extend", 1, h, kvh, d, (1024,) * 16, (64,) * 16),
        AttentionCase("extend 1 x (1024 + 512)", "extend", 1, h, kvh, d, (1024,), (512,)),
        AttentionCase("extend 1 x 512", "extend", 1, h, kvh, d, (0,), (512,)),
        AttentionCase("extend 1 x 2048", "extend", 1, h, kvh, d, (0,), (2048,)),
    ]
    return out


def best_of(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()  # warm up (allocates the workspace)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--backends", default="torch_native,torch_varlen,cpu_paged")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["decode", "extend"], help="run only one mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heads", default="16/8/64", help="num_heads/num_kv_heads/head_dim (qwen2: 16/2/32)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--sliding-window", type=int, help="every case's layer slides this window")
    parser.add_argument("--logit-softcap", type=float, help="every case's layer caps its scores at this")
    parser.add_argument(
        "--timer",
        choices=["wall", "cpu"],
        default="wall",
        help="wall clock, or the process's CPU time (less disturbed by other load)",
    )
    args = parser.parse_args()
    clock = time.perf_counter if args.timer == "wall" else time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)

    registry = get_registry()
    names = args.backends.split(",")
    print(
        f"date {date.today()}  torch {torch.__version__}  threads {torch.get_num_threads()}  "
        f"heads/kv_heads/head_dim {args.heads}  min of {args.repeats}  {args.timer} time  "
        f"window {args.sliding_window}  cap {args.logit_softcap}"
    )
    print(f"{'shape':<28}{'dtype':<10}" + "".join(f"{n:>16}" for n in names) + f"   plan (ms){'':<12}speedup")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for case in shapes(args.seed, args.heads):
            if args.only and case.mode != args.only:
                continue
            case = replace(case, sliding_window=args.sliding_window, logit_softcap=args.logit_softcap)
            inputs = make_attention_inputs(case, dtype)
            batch, query = inputs.batch, case.query("cpu", dtype)
            times, plans = [], []
            for name in names:
                backend = registry.select("attention", query, name)(query)
                backend.init_forward_metadata(batch)
                layer_time = best_of(
                    lambda: backend.forward(inputs.q, inputs.k, inputs.v, inputs.layer, batch), args.repeats, clock
                )
                times.append(layer_time)
                plans.append(best_of(lambda: backend.init_forward_metadata(batch), args.repeats, clock))
            cells = "".join(f"{t:>13.2f} ms" for t in times)
            speedup = "  ".join(f"{times[0] / t:.1f}x" for t in times[1:])
            plan = "/".join(f"{t:.2f}" for t in plans)
            print(f"{case.name:<28}{dtype_name:<10}{cells}   {plan:<21}{speedup}", flush=True)


if __name__ == "__main__":
    main()
