"""Serving benchmark: N concurrent streaming requests against a running server.

    radixserve serve &                      # the demo model, or --model PATH
    python benchmarks/bench_serving.py --url http://127.0.0.1:30000 --num-requests 64 --concurrency 64

Measures, per request, the time to first token (TTFT: request sent -> first
streamed token) and the inter-token latency (ITL: gap between streamed chunks
divided by the tokens they carry, known from ``continuous_usage_stats``), and
overall output throughput (generated tokens / wall time). Prompts are random
words, seeded; ``ignore_eos`` makes every request generate exactly
``--max-tokens`` tokens, so runs are comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass, field

import openai

WORDS = ("radix tree cache prefix batch token stream decode prefill kernel tensor memory page schedule latency "
         "throughput server model request python function the of and to in is you that it for on are as with").split()


@dataclass
class Result:
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    e2e: float = 0.0


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> Result:
    result = Result()
    start = last = time.perf_counter()
    tokens_so_far = 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if not chunk.choices or chunk.usage is None:
            continue
        now = time.perf_counter()
        new_tokens = chunk.usage.completion_tokens - tokens_so_far
        if new_tokens <= 0:
            continue
        if tokens_so_far == 0:
            result.ttft = now - start
        else:
            result.itls.extend([(now - last) / new_tokens] * new_tokens)
        tokens_so_far, last = chunk.usage.completion_tokens, now
    result.completion_tokens = tokens_so_far
    result.e2e = time.perf_counter() - start
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


async def run(args: argparse.Namespace) -> dict:
    async with openai.AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key or "none",
                                  max_retries=0, timeout=3600) as client:
        model = args.model or (await client.models.list()).data[0].id
        prompts = make_prompts(args.num_requests, args.prompt_words, args.seed)
        await one_request(client, model, "warm up", 4)
        limit = asyncio.Semaphore(args.concurrency)

        async def bounded(prompt: str) -> Result:
            async with limit:
                return await one_request(client, model, prompt, args.max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - start
    ttfts = [r.ttft for r in results]
    itls = [x for r in results for x in r.itls]
    generated = sum(r.completion_tokens for r in results)
    return {
        "model": model,
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words,
        "wall_s": wall,
        "generated_tokens": generated,
        "output_throughput_tok_s": generated / wall,
        "request_throughput_req_s": args.num_requests / wall,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "itl_p50_ms": 1000 * percentile(itls, 50),
        "itl_p99_ms": 1000 * percentile(itls, 99),
        "e2e_mean_s": statistics.mean(r.e2e for r in results),
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        print(f"{key:<26} {value:.2f}" if isinstance(value, float) else f"{key:<26} {value}")


if __name__ == "__main__":
    main()
