"""Where a CPU workload's time goes, against the CPU's arithmetic roof.

    python benchmarks/profile_cpu_step.py --model DIR --dtype float32 --workload prefill
    python benchmarks/profile_cpu_step.py --model DIR --workload decode --batch 64 --steps 20
    python benchmarks/profile_cpu_step.py --model DIR --workload w2 --peak-gflops 233

The in-process ``Scheduler`` (as the server runs it, ``auto`` backends) serves one
of compare_vllm_cpu.sh's workloads under ``torch.profiler``:

- ``prefill``: W1's 64 prompts (128-512 random tokens, seed 0), one output token
  each: prefill steps only;
- ``decode``: W1's prompts prefilled, then ``--steps`` decode steps at ``--batch``;
- ``w2``: W2 whole: 8 groups x 16 prompts of a 1024-token shared prefix and a
  64-token question, 32 tokens out, shuffled, radix cache on.

A first pass of the workload (other prompts) warms the kernels. The table gives
each operator's own time and share of the profiled wall time; for the GEMM
operators (ours, oneDNN's, ATen's) also the FLOPs their recorded input shapes
imply and the rate achieved, as a fraction of the CPU's fused multiply-add peak
at the dtype (measured by cpu_peak.py's loops, or ``--peak-gflops``).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoTokenizer

from radixserve.config import ServerArgs
from radixserve.messages import GenerateRequest
from radixserve.runtime.scheduling.scheduler import Scheduler
from radixserve.sampling.params import SamplingParams

# GEMM operators, with which input holds the weight and its layout ("nk": [out, in], as
# F.linear takes it; "kn": [in, out]; "packed": cpu_packed's [out/16, in/G, 16, G]).
GEMM_OPS = {
    "radixserve_cpu_gemm::linear": "packed",
    "radixserve_cpu_gemm::linear_silu_and_mul": "packed",
    "mkldnn::_linear_pointwise": "nk",
    "aten::addmm": "kn",
    "aten::mm": "kn",
}


@dataclass
class OpTime:
    calls: int = 0
    self_us: float = 0.0
    flops: float = 0.0


def gemm_flops(layout: str, shapes: Sequence[Sequence[int]]) -> float:
    """2 * rows * in * out of one call, from its recorded input shapes; 0 where unknown."""
    if layout == "kn":  # addmm(bias, x, w) or mm(x, w)
        x, w = (shapes[1], shapes[2]) if len(shapes) > 2 and len(shapes[0]) <= 1 else (shapes[0], shapes[1])
        return 2.0 * _rows(x) * w[0] * w[1] if len(w) == 2 else 0.0
    x, w = shapes[0], shapes[1]
    if layout == "packed" and len(w) == 4:
        return 2.0 * _rows(x) * w[1] * w[3] * w[0] * 16
    return 2.0 * _rows(x) * w[0] * w[1] if len(w) == 2 else 0.0


def _rows(x: Sequence[int]) -> int:
    rows = 1
    for n in x[:-1]:
        rows *= n
    return rows


def requests(workload: str, vocab: int, seed: int, decode_steps: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max new tokens) of each request, in arrival order."""
    rng = random.Random(seed)
    if workload == "w2":
        prompts = []
        for _ in range(8):
            prefix = [rng.randrange(3, vocab) for _ in range(1024)]
            prompts += [prefix + [rng.randrange(3, vocab) for _ in range(64)] for _ in range(16)]
        rng.shuffle(prompts)
        return [(p, 32) for p in prompts]
    out = 1 if workload == "prefill" else decode_steps + 1
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(128, 512))], out) for _ in range(64)]


def serve(
    scheduler: Scheduler, workload: str, seed: int, batch: int, steps: int, prof: profile | None = None
) -> tuple[float, int]:
    """Run one pass of the workload, under ``prof`` from its first profiled step (decode:
    after the prefill) to its last; return those steps' wall seconds and number."""
    todo = requests(workload, scheduler.runner.vocab_size, seed, steps)
    if workload == "decode":
        todo = todo[:batch]
    for i, (prompt, max_new) in enumerate(todo):
        params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
        scheduler.add_request(GenerateRequest(rid=f"{seed}-{i}", input_ids=prompt, sampling_params=params))
    if workload == "decode":
        while scheduler.waiting or scheduler.chunked_req:
            scheduler.step()
    if prof:
        prof.start()
    started, done = time.perf_counter(), 0
    while scheduler.has_work() and (workload != "decode" or done < steps):
        scheduler.step()
        done += 1
    seconds = time.perf_counter() - started
    if prof:
        prof.stop()
    while scheduler.has_work():  # decode: the step that ends the requests is not profiled
        scheduler.step()
    return seconds, done


def op_times(prof: profile) -> dict[str, OpTime]:
    times: dict[str, OpTime] = defaultdict(OpTime)
    for event in prof.key_averages(group_by_input_shape=True):
        entry = times[event.key]
        entry.calls += event.count
        entry.self_us += event.self_cpu_time_total
        layout = GEMM_OPS.get(event.key)
        if layout and event.input_shapes:
            entry.flops += event.count * gemm_flops(layout, event.input_shapes)
    return times


def measured_peak(dtype: str, threads: int) -> float | None:
    from cpu_peak import peaks  # beside this script

    return peaks(threads, 100_000_000).get(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--workload", default="prefill", choices=["prefill", "decode", "w2"])
    parser.add_argument("--batch", type=int, default=64, help="decode: requests decoding at once (at most 64)")
    parser.add_argument("--steps", type=int, default=20, help="decode: steps profiled")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--peak-gflops", type=float, help="the FMA peak at --dtype (default: measure it)")
    parser.add_argument("--rows", type=int, default=15, help="operators shown, by time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    server_args = ServerArgs(model_path=args.model, dtype=args.dtype, max_total_tokens=60_000, random_seed=0)
    scheduler = Scheduler(server_args, args.model, AutoTokenizer.from_pretrained(args.model))
    serve(scheduler, args.workload, 1, args.batch, args.steps)  # warm-up pass, other prompts
    scheduler.flush_cache()
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    seconds, steps = serve(scheduler, args.workload, 0, args.batch, args.steps, prof)
    peak = args.peak_gflops or measured_peak(args.dtype, args.threads)
    times = op_times(prof)
    print(
        f"{date.today()} {args.workload}, {args.dtype}, {args.threads} threads: {steps} steps in {seconds:.2f} s; "
        f"backends: {scheduler.runner.backends}; FMA peak {peak or 0:.0f} GFLOP/s"
    )
    print(f"{'operator':<46} {'calls':>6} {'self s':>8} {'share':>6} {'GFLOP/s':>8} {'of peak':>7}")
    wall_us = seconds * 1e6
    for name, t in sorted(times.items(), key=lambda kv: -kv[1].self_us)[: args.rows]:
        rate = t.flops / t.self_us / 1e3 if t.flops and t.self_us else None
        rate_cols = f"{rate:8.3g} {rate / peak:7.0%}" if rate and peak else f"{'':8} {'':7}"
        print(f"{name:<46} {t.calls:>6} {t.self_us / 1e6:8.2f} {t.self_us / wall_us:6.1%} {rate_cols}")
    gemm = [t for name, t in times.items() if name in GEMM_OPS]
    gemm_us, gemm_flops_total = sum(t.self_us for t in gemm), sum(t.flops for t in gemm)
    if gemm_us:
        rate = gemm_flops_total / gemm_us / 1e3
        print(
            # three significant digits: a tiny model's GEMMs on a busy machine run under 1 GFLOP/s
            f"GEMM in all: {gemm_us / 1e6:.2f} s ({gemm_us / wall_us:.1%} of the wall), {rate:.3g} GFLOP/s"
            + (f" = {rate / peak:.0%} of the peak" if peak else "")
        )


if __name__ == "__main__":
    main()
