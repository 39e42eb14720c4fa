"""Per-request results, the run summary, its printed report and its JSON line.

Definitions (all from the client's clock, per request): TTFT is request sent ->
first generated token received; ITL the gap between successive received tokens
(a chunk carrying k tokens counts as k gaps of 1/k of its delay); TPOT is
(e2e - TTFT) / (output tokens - 1); e2e is sent -> last token. Throughputs divide
token totals by the run's duration (start of sending -> last request finished).
The cache hit rate is the prompt tokens the engine reports as served from its
prefix cache over all prompt tokens; ``None`` where the engine does not report it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np


@dataclass
class RequestResult:
    prompt_len: int
    sent: float = 0.0  # perf_counter when the request was sent
    token_times: list[float] = field(default_factory=list)  # perf_counter of each received token
    output_len: int = 0
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_len > 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None

    @property
    def itls(self) -> list[float]:
        gaps: list[float] = np.diff(self.token_times).tolist()
        return gaps

    def add_tokens(self, count: int, now: float) -> None:
        """``count`` new tokens arrived at ``now``; spread them over the gap since the last."""
        if count <= 0:
            return
        last = self.token_times[-1] if self.token_times else None
        if last is None:
            self.token_times.append(now)
            count -= 1
            last = now
        step = (now - last) / count if count else 0.0
        self.token_times += [last + step * (i + 1) for i in range(count)]
        self.output_len = len(self.token_times)


class LatencyStats(TypedDict):
    """One latency's distribution, in milliseconds; None without samples."""

    mean: float | None
    median: float | None
    p99: float | None


class BenchSummary(TypedDict):
    """A run's summary: what the report prints and the JSON line holds."""

    completed: int
    failed: int
    errors: list[str]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_latency_ms: LatencyStats
    cache_hit_rate: float | None
    peak_rss_mib: float | None


def _stats(values: list[float], scale: float = 1000.0) -> LatencyStats:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float, peak_rss_bytes: int | None) -> BenchSummary:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    hit_rate = (sum(cached) / input_tokens) if done and input_tokens and len(cached) == len(done) else None
    duration = max(duration, 1e-9)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in done]),
        "tpot_ms": _stats([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": _stats([gap for r in done for gap in r.itls]),
        "e2e_latency_ms": _stats([r.e2e for r in done]),
        "cache_hit_rate": hit_rate,
        "peak_rss_mib": peak_rss_bytes / 2**20 if peak_rss_bytes else None,
    }


def _fmt(value: object) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    return str(value)


def format_report(title: str, summary: BenchSummary) -> str:
    rows: list[tuple[str, object]] = [
        ("Successful requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Benchmark duration (s)", summary["duration_s"]),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Input token throughput (tok/s)", summary["input_throughput"]),
        ("Output token throughput (tok/s)", summary["output_throughput"]),
        ("Total token throughput (tok/s)", summary["total_throughput"]),
        ("Cache hit rate", summary["cache_hit_rate"]),
        ("Peak RSS (MiB)", summary["peak_rss_mib"]),
    ]
    latencies = (
        ("TTFT", summary["ttft_ms"]),
        ("TPOT", summary["tpot_ms"]),
        ("ITL", summary["itl_ms"]),
        ("E2E latency", summary["e2e_latency_ms"]),
    )
    for name, stats in latencies:
        ordered = (("mean", stats["mean"]), ("median", stats["median"]), ("p99", stats["p99"]))
        rows += [(f"{name} {stat} (ms)", value) for stat, value in ordered]
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{'=' * 16} {title} {'=' * 16}"]
    lines += [f"{name:<{width}}{_fmt(value):>14}" for name, value in rows]
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)


def median_call_ms(call: Callable[[], object], n: int) -> float:
    """The median milliseconds of ``n`` calls of ``call``, after one unmeasured call
    (a client's warm-up: its connection is opened there and reused after)."""
    call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000
