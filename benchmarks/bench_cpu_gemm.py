"""Linear-layer throughput on the CPU: the ``torch`` GEMM (``F.linear``) vs ``onednn``
(weights packed once by ``prepare_weight``), on the projections of the W1 model.

    python benchmarks/bench_cpu_gemm.py                               # bf16 and fp32
    python benchmarks/bench_cpu_gemm.py --dtypes bfloat16 --rows 1,32,2048 --repeats 25
    python benchmarks/bench_cpu_gemm.py --threads 1     # steadier on a busy machine

Shapes ``[rows, in] x [in, out]`` for hidden 1024, 16 heads, 8 KV heads, head dim
64, intermediate 2816, vocab 4096: rows 1-128 are decode batches, 512-2048 prefill
chunks. The two backends alternate call by call and each figure is the minimum
over ``--repeats`` calls (the machine is shared: the minimum is the least
disturbed run), as GFLOP/s; a 4096^3 matmul gives the large-matmul rate.
"""

from __future__ import annotations

import argparse
import time
from datetime import date

import torch

from radixserve.kernels import KernelQuery
from radixserve_torch.gemm import OneDnnGemm, TorchGemm

PROJECTIONS = {"qkv": (2048, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816),
               "lm_head": (4096, 1024)}


def best_times(fns, repeats: int) -> list[float]:
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()  # warm up (first-call allocations, oneDNN primitive creation)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,8,32,64,128,512,2048")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    print(f"{date.today()}, torch {torch.__version__}, {torch.get_num_threads()} threads; GFLOP/s, min of {ns.repeats}")
    for dtype in (getattr(torch, d) for d in ns.dtypes.split(",")):
        query = KernelQuery(device="cpu", dtype=dtype)
        ref, fast = TorchGemm(query), OneDnnGemm(query)
        a, b = torch.randn(4096, 4096).to(dtype), torch.randn(4096, 4096).to(dtype)
        (big,) = best_times([lambda: a @ b], max(3, ns.repeats // 5))
        print(f"\n{dtype}: 4096^3 matmul {2 * 4096**3 / big / 1e9:.0f} GFLOP/s")
        print(f"{'projection':10s} {'rows':>5s} {'torch':>7s} {'onednn':>7s} {'ratio':>6s}")
        for name, (out_f, in_f) in PROJECTIONS.items():
            weight = torch.randn(out_f, in_f).to(dtype)
            packed = fast.prepare_weight(weight)
            for rows in (int(r) for r in ns.rows.split(",")):
                x = torch.randn(rows, in_f).to(dtype)
                t_ref, t_fast = best_times([lambda: ref.linear(x, weight), lambda: fast.linear(x, packed)],
                                           ns.repeats)
                flop = 2 * rows * in_f * out_f
                print(f"{name:10s} {rows:5d} {flop / t_ref / 1e9:7.0f} {flop / t_fast / 1e9:7.0f} "
                      f"{t_ref / t_fast:5.2f}x")


if __name__ == "__main__":
    main()
