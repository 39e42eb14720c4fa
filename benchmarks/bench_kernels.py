"""Kernel timings: each registered backend against the torch reference, on
realistic serving shapes built by the conformance kit's input generators.

    python benchmarks/bench_kernels.py --device cuda
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --device cpu --quick   (smoke run)

Times are medians of torch.utils.benchmark (which synchronizes the device).
"""

from __future__ import annotations

import argparse
from datetime import date

import torch
from torch.utils import benchmark

from radixserve.registry import get_registry
from radixserve.testing.conformance import (
    AttentionCase,
    ElementwiseCase,
    MoECase,
    make_attention_inputs,
    make_elementwise_inputs,
    make_moe_inputs,
)

ATTENTION_SHAPES = [
    AttentionCase("decode B64 ctx1024", "decode", 16, 32, 8, 128, (1023,) * 64, (1,) * 64),
    AttentionCase("decode B256 ctx512", "decode", 16, 32, 8, 128, (511,) * 256, (1,) * 256),
    AttentionCase("extend 8x512 prefix512", "extend", 16, 32, 8, 128, (512,) * 8, (512,) * 8),
    AttentionCase("extend 4x2048", "extend", 16, 32, 8, 128, (0,) * 4, (2048,) * 4),
]
MOE_SHAPES = [
    MoECase("moe T64 E64 k8", 64, 2048, 768, 64, 8, True),
    MoECase("moe T1024 E64 k8", 1024, 2048, 768, 64, 8, True),
]
# Llama-3.1-8B's shapes: hidden 4096, 32 heads / 8 KV heads of 128, intermediate 14336
ELEMENTWISE_SHAPES = [
    ElementwiseCase("rmsnorm+res T64 H4096", "rms_norm", 64, hidden=4096, residual=True),
    ElementwiseCase("rmsnorm+res T4096 H4096", "rms_norm", 4096, hidden=4096, residual=True),
    ElementwiseCase("rotary T64 32+8 heads", "rotary", 64, heads=32, kv_heads=8, head_dim=128, strided=True),
    ElementwiseCase("rotary T4096 32+8 heads", "rotary", 4096, heads=32, kv_heads=8, head_dim=128, strided=True),
    ElementwiseCase("silu_and_mul T64 I14336", "silu_and_mul", 64, hidden=14336),
    ElementwiseCase("silu_and_mul T4096 I14336", "silu_and_mul", 4096, hidden=14336),
]
QUICK_ATTENTION = [AttentionCase("decode B4 ctx64", "decode", 16, 8, 2, 64, (63,) * 4, (1,) * 4)]
QUICK_MOE = [MoECase("moe T8 E8 k2", 8, 64, 96, 8, 2, True)]
QUICK_ELEMENTWISE = [
    ElementwiseCase("rmsnorm+res T4 H256", "rms_norm", 4, hidden=256, residual=True),
    ElementwiseCase("rotary T4 4+2 heads", "rotary", 4, heads=4, kv_heads=2, head_dim=64, strided=True),
    ElementwiseCase("silu_and_mul T4 I256", "silu_and_mul", 4, hidden=256),
]


def time_call(fn, min_run_time: float) -> float:
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--backends", default="triton", help="comma-separated backends to compare")
    parser.add_argument("--reference", default="torch_native")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (for a smoke run)")
    args = parser.parse_args()

    registry = get_registry()
    platform = registry.resolve_platform(args.device)()
    device, dtype = platform.device(), getattr(torch, args.dtype)
    names = [args.reference] + args.backends.split(",")
    min_time = 0.05 if args.quick else 0.5
    print(f"date {date.today()}  device {platform.describe()}  dtype {args.dtype}  torch {torch.__version__}")
    print(f"{'shape':<26}" + "".join(f"{n:>16}" for n in names) + "   speedup vs reference")

    for case in QUICK_ATTENTION if args.quick else ATTENTION_SHAPES:
        inputs = make_attention_inputs(case, dtype, device)
        times = []
        for name in names:
            backend = registry.select("attention", case.query(args.device, dtype), name)(case.query(args.device, dtype))
            b = inputs.batch

            def run(backend=backend) -> None:
                backend.init_forward_metadata(b)
                backend.forward(inputs.q, inputs.k, inputs.v, inputs.layer, b)

            times.append(time_call(run, min_time))
        report(case.name, times)

    for case in QUICK_MOE if args.quick else MOE_SHAPES:
        hidden, logits, w13, w2, routing = (
            x.to(device) if torch.is_tensor(x) else x for x in make_moe_inputs(case, dtype)
        )
        times = []
        for name in names:
            backend = registry.select("moe", case.query(args.device, dtype), name)(case.query(args.device, dtype))
            times.append(time_call(lambda backend=backend: backend.forward(hidden, logits, w13, w2, routing), min_time))
        report(case.name, times)

    for case in QUICK_ELEMENTWISE if args.quick else ELEMENTWISE_SHAPES:
        inputs = make_elementwise_inputs(case, dtype, device)  # in-place ops just keep working on their outputs
        times = []
        for name in names:
            backend = registry.select("elementwise", case.query(args.device, dtype), name)(
                case.query(args.device, dtype)
            )
            times.append(time_call(lambda backend=backend: elementwise_call(backend, case, inputs), min_time))
        report(case.name, times)


def elementwise_call(backend, case: ElementwiseCase, inputs: dict) -> None:
    if case.op == "rms_norm":
        backend.rms_norm(inputs["x"], inputs["weight"], case.eps, inputs["residual"])
    elif case.op == "rotary":
        backend.apply_rotary(inputs["q"], inputs["k"], inputs["positions"], inputs["cos_sin_cache"], case.neox_style)
    else:
        backend.silu_and_mul(inputs["x"])


def report(name: str, times: list[float]) -> None:
    ref = times[0]
    cells = "".join(f"{t * 1e3:>13.3f} ms" for t in times)
    speedups = "  ".join(f"{ref / t:.2f}x" for t in times[1:])
    print(f"{name:<26}{cells}   {speedups}")


if __name__ == "__main__":
    main()
