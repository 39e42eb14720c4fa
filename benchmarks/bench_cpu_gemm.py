"""Linear-layer throughput of the CPU GEMM backends (``torch``: ``F.linear``;
``onednn`` and ``cpu_packed``: weights packed once by ``prepare_weight``) on the
projections of the W1 model.

    python benchmarks/bench_cpu_gemm.py                                  # warm weights, bf16 and fp32
    python benchmarks/bench_cpu_gemm.py --cold --dtypes bfloat16 --backends onednn,cpu_packed
    python benchmarks/bench_cpu_gemm.py --dtypes bfloat16 --rows 1,32,2048 --repeats 25
    python benchmarks/bench_cpu_gemm.py --threads 1     # steadier on a busy machine

Shapes ``[rows, in] x [in, out]`` for hidden 1024, 16 heads, 8 KV heads, head dim
64, intermediate 2816, vocab 4096: rows 1-128 are decode batches, 512-2048 prefill
chunks. Warm (the default): one weight, called again and again, so it sits in
cache. ``--cold``: each call takes the next of enough copies of the weight to
fill 256 MB, as in a serving step, where every layer's weights come from memory
once per step. The backends alternate call by call and each figure is the
minimum over ``--repeats`` calls (warm) or passes over the copies (cold), in
GFLOP/s, with each backend's ratio to the first; a 4096^3 matmul gives the
large-matmul rate.
"""

from __future__ import annotations

import argparse
import time
from datetime import date

import torch

from radixserve.kernels import KernelQuery
from radixserve.registry import PluginError, get_registry

PROJECTIONS = {
    "qkv": (2048, 1024),
    "o": (1024, 1024),
    "gate_up": (5632, 1024),
    "down": (1024, 2816),
    "lm_head": (4096, 1024),
}
COLD_BYTES = 256 << 20


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
    parser.add_argument(
        "--backends",
        default="torch,onednn,cpu_packed",
        help="GEMM backends, the first is the baseline of the ratios; those that do not "
        "apply to a dtype are left out with their reason",
    )
    parser.add_argument("--rows", default="1,8,32,64,128,512,2048")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cold", action="store_true", help="cycle through 256 MB of weight copies")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    registry = get_registry()
    print(
        f"{date.today()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{'cold' if ns.cold else 'warm'} weights; GFLOP/s, min of {ns.repeats}"
    )
    for dtype in (getattr(torch, d) for d in ns.dtypes.split(",")):
        query = KernelQuery(device="cpu", dtype=dtype)
        backends = []
        for name in ns.backends.split(","):
            try:
                backends.append(registry.select("gemm", query, name)(query))
            except PluginError as exc:
                print(f"{dtype}: {name} left out: {exc}")
        a, b = torch.randn(4096, 4096).to(dtype), torch.randn(4096, 4096).to(dtype)
        (big,) = best_times([lambda: a @ b], max(3, ns.repeats // 5))
        print(f"\n{dtype}: 4096^3 matmul {2 * 4096**3 / big / 1e9:.0f} GFLOP/s")
        print(
            f"{'projection':10s} {'rows':>5s} "
            + " ".join(f"{g.name:>9s}" for g in backends)
            + " "
            + " ".join(f"{g.name + '/' + backends[0].name:>16s}" for g in backends[1:])
        )
        for name, (out_f, in_f) in PROJECTIONS.items():
            copies = max(1, COLD_BYTES // (out_f * in_f * dtype.itemsize)) if ns.cold else 1
            dense = [torch.randn(out_f, in_f).to(dtype) for _ in range(copies)]
            weights = [[g.prepare_weight(w) for w in dense] for g in backends]
            del dense
            for rows in (int(r) for r in ns.rows.split(",")):
                x = torch.randn(rows, in_f).to(dtype)
                calls = [
                    lambda g=g, ws=ws: [g.linear(x, w) for w in ws] for g, ws in zip(backends, weights, strict=False)
                ]
                times = [t / copies for t in best_times(calls, ns.repeats if not ns.cold or rows < 512 else 2)]
                flop = 2 * rows * in_f * out_f
                print(
                    f"{name:10s} {rows:5d} "
                    + " ".join(f"{flop / t / 1e9:9.0f}" for t in times)
                    + " "
                    + " ".join(f"{times[0] / t:15.2f}x" for t in times[1:])
                )


if __name__ == "__main__":
    main()
