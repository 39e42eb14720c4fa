"""The arithmetic peak of this CPU's cores, the roof the CPU figures are read against.

    python benchmarks/cpu_peak.py            # every core; --threads N for fewer

A loop of independent AVX-512 multiply-adds held in registers (no memory traffic),
one thread per core: bfloat16 pairs by ``vdpbf16ps`` (64 FLOP per instruction) and
float32 by ``vfmadd`` (32 FLOP). It is what no kernel can beat, unlike a large
``torch.matmul``, which measures one library's GEMM. Built with the flags the CPU
kernels use (``-O3 -march=native``) by torch's extension builder; needs AVX-512,
and AVX512_BF16 for the bfloat16 row.
"""

from __future__ import annotations

import argparse
import os

from torch.utils.cpp_extension import load_inline

# Twelve accumulators, each with its own multiplicand, so the compiler can neither
# merge the chains nor stall on one (a multiply-add's latency is a few cycles);
# the sum at the end keeps them alive.
SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

// acc[i] = step(acc[i], x[i]) for twelve accumulators, fully unrolled so they stay in registers.
template <typename In, typename Input, typename Step>
double loop(int64_t iters, Input input, Step step) {
  __m512 acc[12];
  In x[12];
  for (int i = 0; i < 12; ++i) {
    acc[i] = _mm512_setzero_ps();
    x[i] = input(i);
  }
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = step(acc[i], x[i]);
  }
  double s = 0;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

double bf16_loop(int64_t iters) {
#if defined(__AVX512BF16__)
  const __m512bh y = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  return loop<__m512bh>(
      iters, [](int i) { return (__m512bh)_mm512_set1_epi32(0x3c003c00 + i); },
      [y](__m512 a, __m512bh x) { return _mm512_dpbf16_ps(a, x, y); });
#else
  return -1;
#endif
}

double fp32_loop(int64_t iters) {
  const __m512 y = _mm512_set1_ps(1.0f);
  return loop<__m512>(
      iters, [](int i) { return _mm512_set1_ps(1e-9f * (i + 1)); },
      [y](__m512 a, __m512 x) { return _mm512_fmadd_ps(x, y, a); });
}

// Seconds for `threads` threads to run `iters` iterations each of loop `kind`
// (0: bfloat16, 1: float32); -1 where the bfloat16 loop was not compiled.
double run(int64_t kind, int64_t threads, int64_t iters) {
  if (kind == 0 && bf16_loop(1) < 0) return -1;
  std::vector<double> sink(threads);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { sink[t] = kind == 0 ? bf16_loop(iters) : fp32_loop(iters); });
  for (auto& thread : pool) thread.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
"""

INSTRUCTIONS_PER_ITERATION = 12
# dtype: (loop kind, FLOP per instruction, instruction)
LOOPS = {"bfloat16": (0, 64, "vdpbf16ps"), "float32": (1, 32, "vfmadd")}


def peaks(threads: int, iterations: int) -> dict[str, float | None]:
    """GFLOP/s of each dtype's loop on ``threads`` threads; None where it was not
    compiled for this CPU (bfloat16 without AVX512_BF16)."""
    module = load_inline(
        "radixserve_cpu_peak", cpp_sources=SOURCE, functions=["run"], extra_cflags=["-O3", "-march=native"]
    )
    rates: dict[str, float | None] = {}
    for dtype, (kind, flop_per_instruction, _) in LOOPS.items():
        module.run(kind, threads, iterations // 10)  # wake the cores up to speed first
        seconds = module.run(kind, threads, iterations)
        instructions = threads * iterations * INSTRUCTIONS_PER_ITERATION
        rates[dtype] = instructions * flop_per_instruction / seconds / 1e9 if seconds >= 0 else None
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--iterations", type=int, default=100_000_000)
    args = parser.parse_args()
    for dtype, rate in peaks(args.threads, args.iterations).items():
        _, flop_per_instruction, instruction = LOOPS[dtype]
        if rate is None:
            print(f"{dtype} ({instruction}): not compiled for this CPU (no AVX512_BF16)")
            continue
        per_thread = rate / flop_per_instruction / args.threads
        print(
            f"{dtype} ({instruction}): {rate:.0f} GFLOP/s on {args.threads} threads "
            f"({per_thread:.2f} G instructions/s per thread)"
        )


if __name__ == "__main__":
    main()
